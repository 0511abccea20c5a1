// CPU blockwise attention backward with the final global lse and delta (FlashAttention-2
// Alg. 2; BurstAttention Alg. 2; NOTES.md §0 and §7.2): P = exp(S - lse), dV = Pᵀ·dO,
// dS = P ∘ (dO·Vᵀ - delta), dQ = scale·dS·K, dK = scale·dSᵀ·Q.
// Work is split by (batch, K/V head, chunk of key tiles): a task owns its dK/dV tiles outright
// and the dQ rows of its K/V head group, so no two threads write the same element and the
// result is deterministic for a given thread count. Chunks > 1 (only when batch x K/V heads is
// below the thread count) add into private dQ copies that are summed in a fixed order.
#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <limits>

#include "kernels/mask.h"
#include "kernels/registry.h"

namespace lvx::kernels {
namespace {

constexpr int64_t kQTile = kCpuQTile;
constexpr int64_t kKTile = kCpuKTile;

template <typename T>
void backward_cpu_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& delta,
                        double scale, const PreparedMask& pm, AttentionGrads& g,
                        AttentionStats* stats) {
  const int64_t batch = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t skv = k.size(1), hkv = k.size(2), group = hq / hkv;
  const int64_t n_qt = pm.n_q_tiles, n_kt = pm.n_k_tiles;
  const auto acc = g.dk.scalar_type();
  const T inf = std::numeric_limits<T>::infinity();
  const int64_t threads = at::get_num_threads();
  const int64_t chunks =
      std::max<int64_t>(1, std::min(n_kt, (threads + batch * hkv - 1) / (batch * hkv)));
  const int64_t kt_per_chunk = (n_kt + chunks - 1) / chunks;
  at::Tensor dq_parts =
      chunks == 1 ? g.dq.unsqueeze(0) : at::zeros({chunks, batch, sq, hq, d}, g.dq.options());
  const T* lse_ptr = lse.data_ptr<T>();
  const T* delta_ptr = delta.data_ptr<T>();
  std::atomic<int64_t> total{0}, skipped{0}, full{0};

  // Tasks of less than ~4 MFLOP are grouped so tiny calls stay on one thread.
  const int64_t task_flops = 8 * group * sq * std::min(skv, kt_per_chunk * kKTile) * d;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 22) / std::max<int64_t>(1, task_flops));
  at::parallel_for(0, batch * hkv * chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t c = task % chunks, hk = (task / chunks) % hkv, b = task / (chunks * hkv);
      at::Tensor dq_b = dq_parts.select(0, c).select(0, b);  // [Sq, Hq, D]
      const int64_t kt_end = std::min(n_kt, (c + 1) * kt_per_chunk);
      int64_t n_total = 0, n_skip = 0, n_full = 0;
      for (int64_t kt = c * kt_per_chunk; kt < kt_end; ++kt) {
        const int64_t j0 = kt * kKTile, tk = std::min(kKTile, skv - j0);
        const TileSummary ks = pm.k_summary(b, kt);
        at::Tensor k_tile = k.select(0, b).select(1, hk).narrow(0, j0, tk).to(acc);
        at::Tensor v_tile = v.select(0, b).select(1, hk).narrow(0, j0, tk).to(acc);
        at::Tensor dk_acc = at::zeros({tk, d}, g.dk.options());
        at::Tensor dv_acc = at::zeros({tk, d}, g.dv.options());
        for (int64_t h = hk * group; h < (hk + 1) * group; ++h) {
          for (int64_t qt = 0; qt < n_qt; ++qt) {
            ++n_total;
            const auto vis = classify_tile(pm.view.kind, pm.view.rule, pm.q_summary(b, qt), ks);
            if (vis == TileVisibility::kNone) {
              ++n_skip;
              continue;
            }
            const int64_t i0 = qt * kQTile, tq = std::min(kQTile, sq - i0);
            at::Tensor q_tile = q.select(0, b).select(1, h).narrow(0, i0, tq).to(acc).mul(scale);
            at::Tensor do_tile = dout.select(0, b).select(1, h).narrow(0, i0, tq).to(acc);
            at::Tensor p = at::mm(q_tile, k_tile.t());  // S, then P in place
            T* pp = p.data_ptr<T>();
            if (vis == TileVisibility::kPartial) {
              for (int64_t r = 0; r < tq; ++r) {
                for (int64_t x = 0; x < tk; ++x) {
                  if (!pm.view.visible(b, i0 + r, j0 + x)) pp[r * tk + x] = -inf;
                }
              }
            } else {
              ++n_full;
            }
            const T* lse_row = lse_ptr + (b * hq + h) * sq + i0;
            const T* delta_row = delta_ptr + (b * hq + h) * sq + i0;
            for (int64_t r = 0; r < tq; ++r) {
              // A row that sees no key anywhere has lse = -inf: use +inf so P = exp(S - inf) = 0
              // instead of exp(-inf + inf) = NaN (+inf is already the flash-attn convention).
              const T l = lse_row[r] == -inf ? inf : lse_row[r];
              for (int64_t x = 0; x < tk; ++x) pp[r * tk + x] -= l;
            }
            p.exp_();
            dv_acc.addmm_(p.t(), do_tile);
            at::Tensor ds = at::mm(do_tile, v_tile.t());  // dP, then dS in place
            T* dsp = ds.data_ptr<T>();
            for (int64_t r = 0; r < tq; ++r) {
              const T dl = delta_row[r];
              for (int64_t x = 0; x < tk; ++x) {
                const T pv = pp[r * tk + x];
                dsp[r * tk + x] = pv == T(0) ? T(0) : pv * (dsp[r * tk + x] - dl);
              }
            }
            dk_acc.addmm_(ds.t(), q_tile);  // q_tile carries the scale
            at::Tensor dq_rows = dq_b.select(1, h).narrow(0, i0, tq);
            dq_rows.addmm_(ds, k_tile, 1.0, scale);
          }
        }
        g.dk.select(0, b).select(1, hk).narrow(0, j0, tk).copy_(dk_acc);
        g.dv.select(0, b).select(1, hk).narrow(0, j0, tk).copy_(dv_acc);
      }
      total += n_total;
      skipped += n_skip;
      full += n_full;
    }
  });
  if (chunks > 1) at::sum_out(g.dq, dq_parts, {0});
  if (stats != nullptr) {
    stats->tiles_total += total;
    stats->tiles_skipped += skipped;
    stats->tiles_full += full;
  }
}

}  // namespace

AttentionGrads attention_backward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& dout, const at::Tensor& lse,
                                      const at::Tensor& delta, double scale,
                                      const AttentionMask& mask, AttentionStats* stats) {
  const auto acc = accumulation_dtype(q.scalar_type());
  AttentionGrads g{at::zeros(q.sizes(), q.options().dtype(acc)),
                   at::zeros(k.sizes(), k.options().dtype(acc)),
                   at::zeros(v.sizes(), v.options().dtype(acc))};
  if (q.size(1) == 0 || k.size(1) == 0) return g;
  const PreparedMask pm =
      prepare_mask(mask, q.size(0), q.size(1), k.size(1), kQTile, kKTile, at::kCPU);
  if (acc == at::kDouble) {
    backward_cpu_typed<double>(q, k, v, dout, lse, delta, scale, pm, g, stats);
  } else {
    backward_cpu_typed<float>(q, k, v, dout, lse, delta, scale, pm, g, stats);
  }
  return g;
}

}  // namespace lvx::kernels
