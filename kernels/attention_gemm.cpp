#include "kernels/attention_gemm.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/mask.h"
#include "kernels/registry.h"
#include "src/common/error.h"

namespace lvx::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kScoreBytes = int64_t{256} << 20;  // fp32 scores of one key chunk

// a @ b with fp32 output: on CUDA, bf16/fp16 operands on tensor cores with fp32 accumulation and
// output (bmm.dtype); elsewhere the operands are widened to fp32 first.
at::Tensor gemm32(const at::Tensor& a, const at::Tensor& b) {
  if (a.is_cuda() && a.scalar_type() != at::kFloat) return at::bmm(a, b, at::kFloat);
  return at::bmm(a.to(at::kFloat), b.to(at::kFloat));
}

struct Rows {
  int64_t b, sq, hq, hkv, g, d, skv;
};

// [B, S, Hq, D] → [B·Hkv, g·S, D]: the g query heads of each K/V head stacked as rows.
at::Tensor to_rows(const at::Tensor& x, const Rows& r) {
  return x.reshape({r.b, x.size(1), r.hkv, r.g, r.d})
      .permute({0, 2, 3, 1, 4})
      .reshape({r.b * r.hkv, r.g * x.size(1), r.d});
}
at::Tensor from_rows(const at::Tensor& x, const Rows& r) {
  return x.reshape({r.b, r.hkv, r.g, r.sq, r.d})
      .permute({0, 3, 1, 2, 4})
      .reshape({r.b, r.sq, r.hq, r.d});
}
// [B, Hq, Sq] ↔ [B·Hkv, g·Sq]
at::Tensor stat_rows(const at::Tensor& x, const Rows& r) {
  return x.reshape({r.b * r.hkv, r.g * r.sq});
}
at::Tensor stat_from_rows(const at::Tensor& x, const Rows& r) {
  return x.reshape({r.b, r.hq, r.sq});
}
// [B, S, Hkv, D] → [B·Hkv, S, D]
at::Tensor kv_rows(const at::Tensor& x, const Rows& r) {
  return x.permute({0, 2, 1, 3}).reshape({r.b * r.hkv, x.size(1), r.d});
}
at::Tensor kv_from_rows(const at::Tensor& x, const Rows& r) {
  return x.reshape({r.b, r.hkv, r.skv, r.d}).permute({0, 2, 1, 3});
}

// The mask's metadata restricted to keys [k0, k1), on `dev`.
AttentionMask chunk_mask(const AttentionMask& m, int64_t k0, int64_t k1, const at::Device& dev) {
  AttentionMask c = m;
  auto on = [&](const at::Tensor& t) { return t.defined() ? t.to(dev) : t; };
  c.q_pos = on(m.q_pos);
  c.q_media = on(m.q_media);
  if (m.k_pos.defined()) c.k_pos = on(m.k_pos.narrow(0, k0, k1 - k0));
  if (m.kv_media.defined()) c.kv_media = on(m.kv_media.narrow(1, k0, k1 - k0));
  if (m.kv_valid.defined()) c.kv_valid = on(m.kv_valid.narrow(1, k0, k1 - k0));
  return c;
}

enum class ChunkKind { kSkip, kFull, kMasked };

// The visibility of every key chunk of size `c`, decided on the host from each chunk's min/max
// of the mask metadata (classify_tile, kernels/mask.h), so the chunk loop never waits on the
// device: the metadata goes to the host once per call (the runtime builds it there), never once
// per chunk. Exact for causal and media-up-to masks, conservative (kMasked: the chunk's mask is
// built) for media-immediate and padding, where min/max cannot tell.
std::vector<ChunkKind> plan_chunks(const AttentionMask& mask, const Rows& r, int64_t c) {
  const int64_t n = (r.skv + c - 1) / c;
  if (mask.kind == MaskKind::kNone && !mask.kv_valid.defined())
    return std::vector<ChunkKind>(static_cast<size_t>(n), ChunkKind::kFull);
  if (r.sq == 0 || r.b == 0)
    return std::vector<ChunkKind>(static_cast<size_t>(n), ChunkKind::kSkip);
  const PreparedMask pm = prepare_mask(mask, r.b, r.sq, r.skv, r.sq, c, at::kCPU);
  std::vector<ChunkKind> kinds(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) {
    bool any = false, all = true;
    for (int64_t b = 0; b < r.b; ++b) {
      const TileVisibility v =
          classify_tile(pm.view.kind, pm.view.rule, pm.q_summary(b, 0), pm.k_summary(b, t));
      any = any || v != TileVisibility::kNone;
      all = all && v == TileVisibility::kFull;
    }
    kinds[static_cast<size_t>(t)] = !any  ? ChunkKind::kSkip
                                    : all ? ChunkKind::kFull
                                          : ChunkKind::kMasked;
  }
  return kinds;
}

// The visibility matrix of a masked chunk ([B·Hkv, g·Sq, C] bool, broadcast over the g heads),
// built on the device from `dmask` (the mask with its metadata already there).
at::Tensor chunk_visibility(const AttentionMask& dmask, const Rows& r, int64_t k0, int64_t k1,
                            const at::Device& dev) {
  at::Tensor m = mask_matrix(chunk_mask(dmask, k0, k1, dev), r.b, r.sq, k1 - k0);  // [B, Sq, C]
  return m.unsqueeze(1)
      .unsqueeze(1)
      .expand({r.b, r.hkv, r.g, r.sq, k1 - k0})
      .reshape({r.b * r.hkv, r.g * r.sq, k1 - k0});
}

int64_t chunk_size(const Rows& r) {
  const int64_t per_key = std::max<int64_t>(1, r.b * r.hq * r.sq * 4);
  return std::clamp<int64_t>(kScoreBytes / per_key / 128 * 128, 128, std::max<int64_t>(128, r.skv));
}

Rows dims(const at::Tensor& q, const at::Tensor& k) {
  return {q.size(0), q.size(1), q.size(2), k.size(2), q.size(2) / k.size(2), q.size(3), k.size(1)};
}

// The key chunks of a block, in order: [k0, k1), the chunk's kind and, for a masked one, its
// visibility. Every chunk is counted in `stats`; skipped ones never reach `body`.
template <typename Body>
void for_each_chunk(const AttentionMask& mask, const Rows& r, const at::Device& device,
                    AttentionStats* stats, Body&& body) {
  const int64_t c = chunk_size(r);
  const std::vector<ChunkKind> kinds = plan_chunks(mask, r, c);
  const AttentionMask dmask = chunk_mask(mask, 0, r.skv, device);  // metadata moved once
  for (int64_t k0 = 0; k0 < r.skv; k0 += c) {
    const int64_t k1 = std::min(r.skv, k0 + c);
    const ChunkKind kind = kinds[static_cast<size_t>(k0 / c)];
    if (stats) {
      ++stats->tiles_total;
      stats->tiles_skipped += kind == ChunkKind::kSkip;
      stats->tiles_full += kind == ChunkKind::kFull;
    }
    if (kind == ChunkKind::kSkip) continue;
    body(k0, k1,
         kind == ChunkKind::kMasked ? chunk_visibility(dmask, r, k0, k1, device) : at::Tensor());
  }
}

// The device's chunk passes (kernels/registry.h: the CPU's below, CUDA's fused kernels).
const AttentionImpl& chunk_passes(const at::Tensor& q) {
  const AttentionImpl* impl = find_attention_impl(q.device().type());
  LVX_CHECK(impl && impl->chunk_forward && impl->chunk_backward,
            "attention (gemm path): no chunk passes for device ", q.device());
  return *impl;
}

}  // namespace

void softmax_chunk_forward_cpu(const at::Tensor& s, double scale, at::Tensor& m, at::Tensor& l,
                               at::Tensor& alpha, at::Tensor& p) {
  const at::Tensor scaled = s * scale;
  const at::Tensor m_new = at::maximum(m, std::get<0>(scaled.max(-1)));
  // Rows with nothing visible yet keep m = −inf: shift by 0 there so exp() gives 0, not NaN.
  const at::Tensor shift = at::where(at::isinf(m_new), at::zeros_like(m_new), m_new);
  const at::Tensor e = at::exp(scaled.sub_(shift.unsqueeze(-1)));
  alpha = at::exp(m - shift);
  l.mul_(alpha).add_(e.sum(-1));
  m.copy_(m_new);
  p = e.to(p.scalar_type());
}

void softmax_chunk_backward_cpu(const at::Tensor& s, const at::Tensor& dp, double scale,
                                const at::Tensor& lse, const at::Tensor& delta, at::Tensor& p,
                                at::Tensor& ds) {
  // Empty rows (lse = ±inf) contribute nothing: P = 0 there.
  const at::Tensor row_ok = at::isfinite(lse).unsqueeze(-1);
  const at::Tensor lse_r = at::where(at::isfinite(lse), lse, at::zeros_like(lse)).unsqueeze(-1);
  at::Tensor e = at::exp((s * scale).sub_(lse_r));
  e = at::where(row_ok, e, at::zeros_like(e));
  const auto dt = p.scalar_type();
  ds = (e * (dp - delta.unsqueeze(-1))).to(dt);  // P∘(dP − δ)
  p = e.to(dt);
}

AttentionOutput attention_forward_gemm(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, double scale, const AttentionMask& mask,
                                       AttentionStats* stats) {
  const Rows r = dims(q, k);
  const auto f32 = q.options().dtype(at::kFloat);
  const at::Tensor qh = to_rows(q, r), kh = kv_rows(k, r), vh = kv_rows(v, r);
  at::Tensor acc = at::zeros({r.b * r.hkv, r.g * r.sq, r.d}, f32);
  at::Tensor m = at::full({r.b * r.hkv, r.g * r.sq}, -kInf, f32);
  at::Tensor l = at::zeros({r.b * r.hkv, r.g * r.sq}, f32);
  const AttentionImpl& passes = chunk_passes(q);
  for_each_chunk(mask, r, q.device(), stats, [&](int64_t k0, int64_t k1, const at::Tensor& vis) {
    at::Tensor s = gemm32(qh, kh.narrow(1, k0, k1 - k0).transpose(1, 2));
    if (vis.defined()) s.masked_fill_(vis.logical_not(), -kInf);
    at::Tensor p = at::empty(s.sizes(), s.options().dtype(q.scalar_type()));
    at::Tensor alpha = at::empty_like(m);
    passes.chunk_forward(s, scale, m, l, alpha, p);
    acc.mul_(alpha.unsqueeze(-1)).add_(gemm32(p, vh.narrow(1, k0, k1 - k0)));
  });
  at::Tensor empty = l.eq(0);
  at::Tensor o = acc.div_(at::where(empty, at::ones_like(l), l).unsqueeze(-1));
  at::Tensor lse = at::where(empty, at::full_like(l, -kInf), m + at::log(l));
  return {from_rows(o, r).contiguous(), stat_from_rows(lse, r).contiguous()};
}

AttentionGrads attention_backward_gemm(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& dout,
                                       const at::Tensor& lse, const at::Tensor& delta, double scale,
                                       const AttentionMask& mask, AttentionStats* stats) {
  const Rows r = dims(q, k);
  const auto f32 = q.options().dtype(at::kFloat);
  const auto dt = q.scalar_type();
  const at::Tensor qh = to_rows(q, r), kh = kv_rows(k, r), vh = kv_rows(v, r);
  const at::Tensor doh = to_rows(dout.to(dt), r);
  const at::Tensor lse_rows = stat_rows(lse.to(at::kFloat), r).contiguous();
  const at::Tensor delta_rows = stat_rows(delta.to(at::kFloat), r).contiguous();
  at::Tensor dq = at::zeros({r.b * r.hkv, r.g * r.sq, r.d}, f32);
  at::Tensor dk = at::zeros({r.b * r.hkv, r.skv, r.d}, f32);
  at::Tensor dv = at::zeros({r.b * r.hkv, r.skv, r.d}, f32);
  const AttentionImpl& passes = chunk_passes(q);
  for_each_chunk(mask, r, q.device(), stats, [&](int64_t k0, int64_t k1, const at::Tensor& vis) {
    const int64_t n = k1 - k0;
    const at::Tensor kc = kh.narrow(1, k0, n), vc = vh.narrow(1, k0, n);
    at::Tensor s = gemm32(qh, kc.transpose(1, 2));
    if (vis.defined()) s.masked_fill_(vis.logical_not(), -kInf);
    const at::Tensor dp = gemm32(doh, vc.transpose(1, 2));
    at::Tensor p = at::empty(s.sizes(), s.options().dtype(dt)), ds = at::empty_like(p);
    passes.chunk_backward(s, dp, scale, lse_rows, delta_rows, p, ds);
    dv.narrow(1, k0, n).add_(gemm32(p.transpose(1, 2), doh));
    dq.add_(gemm32(ds, kc), scale);
    dk.narrow(1, k0, n).add_(gemm32(ds.transpose(1, 2), qh), scale);
  });
  return {from_rows(dq, r).contiguous(), kv_from_rows(dk, r).contiguous(),
          kv_from_rows(dv, r).contiguous()};
}

}  // namespace lvx::kernels
