// The shared plan of the fused path and its CPU table (issue 21, "Local attention on ATen's fused
// kernels"; the plan, the O' trick of the backward and the per-device op choice are stated in
// kernels/attention_fused.h). The CPU table calls at::_scaled_dot_product_flash_attention_for_cpu
// and its backward for bf16/fp16/fp32 (FlashAttention-2 tiling, Dao 2023, Alg. 1/2; it returns
// the natural-log lse in fp32, and its backward takes the final global O and lse, which is the
// ring backward's contract, NOTES.md §7.2); which CPU path serves a block (fused, lvx's GEMM
// path, lvx's own kernels for fp64 or when chosen) is kernels/cpu_path.h's choice. The CUDA table
// is attention_fused_cuda.cpp.
//
// Over 600 lines on purpose: the plan (tiles, runs, pieces), the per-piece calls (forward_piece,
// backward_piece) and the whole-block call share private types (Plan, Piece, FusedCall helpers)
// and must make the same calls forward and backward; one file keeps them, and that invariant, in
// one anonymous namespace. The CPU table at its end is the only other part (~30 lines).
#include "kernels/attention_fused.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/attention_gemm.h"
#include "kernels/cpu_path.h"
#include "kernels/mask.h"
#include "kernels/registry.h"

namespace lvx::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// Additive mask elements of one masked call (rows are cut so the mask stays <= 64 MiB fp32).
constexpr int64_t kMaskElems = int64_t{16} << 20;

struct Run {
  int64_t kt0, kt1;  // key tiles [kt0, kt1)
  bool full;         // every tile of the run is fully visible
  bool operator==(const Run& o) const { return kt0 == o.kt0 && kt1 == o.kt1 && full == o.full; }
};

struct Group {
  int64_t b, qt0, qt1;  // batch row, query tiles [qt0, qt1)
  std::vector<Run> runs;
};

struct Plan {
  std::vector<Group> groups;
  int64_t total = 0, skipped = 0, full = 0, fused = 0;  // tiles, per query head
};

Plan make_plan(const PreparedMask& pm, int64_t batch) {
  Plan plan;
  const int64_t n_qt = pm.n_q_tiles, n_kt = pm.n_k_tiles;
  std::vector<TileVisibility> vis(n_qt * n_kt);
  std::vector<int64_t> lo(n_qt), hi(n_qt);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t qt = 0; qt < n_qt; ++qt) {
      const TileSummary qs = pm.q_summary(b, qt);
      lo[qt] = n_kt;
      hi[qt] = -1;
      for (int64_t kt = 0; kt < n_kt; ++kt) {
        const auto t = classify_tile(pm.view.kind, pm.view.rule, qs, pm.k_summary(b, kt));
        vis[qt * n_kt + kt] = t;
        if (t != TileVisibility::kNone) {
          lo[qt] = std::min(lo[qt], kt);
          hi[qt] = kt;
        }
        plan.full += t == TileVisibility::kFull;
      }
      plan.total += n_kt;
      const int64_t in_range = hi[qt] >= lo[qt] ? hi[qt] - lo[qt] + 1 : 0;
      plan.fused += in_range;
      plan.skipped += n_kt - in_range;
    }
    // The longest run of key tiles fully visible to every query tile of the row is one call
    // for all its queries (the op's own tiling then sees every query at once: a ring block
    // just below the diagonal, the media every query sees); the rest goes by query tile.
    int64_t a = 0, c = 0;
    if (n_qt > 1) {
      for (int64_t kt = 0, start = 0; kt <= n_kt; ++kt) {
        bool common = kt < n_kt;
        for (int64_t qt = 0; common && qt < n_qt; ++qt) {
          common = vis[qt * n_kt + kt] == TileVisibility::kFull;
        }
        if (common) continue;
        if (kt - start > c - a) {
          a = start;
          c = kt;
        }
        start = kt + 1;
      }
    }
    if (c > a) plan.groups.push_back({b, 0, n_qt, {Run{a, c, true}}});
    for (int64_t qt = 0; qt < n_qt; ++qt) {
      std::vector<Run> runs;
      for (int64_t kt = lo[qt]; kt <= hi[qt]; ++kt) {
        if (kt >= a && kt < c) continue;
        const bool f = vis[qt * n_kt + kt] == TileVisibility::kFull;
        if (runs.empty() || runs.back().full != f || runs.back().kt1 != kt) {
          runs.push_back({kt, kt, f});
        }
        runs.back().kt1 = kt + 1;
      }
      if (runs.empty()) continue;  // nothing (else) visible: o = 0, lse = −inf if nothing at all
      Group* last = plan.groups.empty() ? nullptr : &plan.groups.back();
      if (last != nullptr && last->b == b && last->qt1 == qt && last->runs == runs) {
        last->qt1 = qt + 1;
      } else {
        plan.groups.push_back({b, qt, qt + 1, std::move(runs)});
      }
    }
  }
  return plan;
}

// An unmasked block: no kind and no key padding. Every tile is fully visible, so the plan is
// one full run per batch row, known without the host-side mask summaries (prepare_mask's ~20
// small tensor ops, about 0.1 ms of host time per call before the GPU gets its kernel: the
// profile in docs/kernels.md).
bool unmasked(const AttentionMask& m) { return m.kind == MaskKind::kNone && !m.kv_valid.defined(); }

// What prepare_mask and make_plan (with whole_block_if_causal) give an unmasked block, built
// directly: the tile counts, a view of kind none, and one full run per batch row.
std::pair<PreparedMask, Plan> plan_unmasked(int64_t batch, int64_t sq, int64_t skv) {
  PreparedMask pm;
  pm.q_tile = kCpuQTile;
  pm.k_tile = kCpuKTile;
  pm.n_q_tiles = (sq + kCpuQTile - 1) / kCpuQTile;
  pm.n_k_tiles = (skv + kCpuKTile - 1) / kCpuKTile;
  pm.view.kind = static_cast<int>(MaskKind::kNone);
  pm.view.sq = sq;
  pm.view.skv = skv;
  Plan plan;
  for (int64_t b = 0; b < batch; ++b) {
    plan.groups.push_back({b, 0, pm.n_q_tiles, {Run{0, pm.n_k_tiles, true}}});
  }
  plan.total = plan.full = plan.fused = batch * pm.n_q_tiles * pm.n_k_tiles;
  return {std::move(pm), std::move(plan)};
}

// mask restricted to batch row b, queries [i0, i1) and keys [j0, j1) (same kinds and rules).
AttentionMask sub_mask(const AttentionMask& m, int64_t b, int64_t i0, int64_t i1, int64_t j0,
                       int64_t j1) {
  AttentionMask s = m;
  if (m.q_pos.defined()) s.q_pos = m.q_pos.narrow(0, i0, i1 - i0);
  if (m.k_pos.defined()) s.k_pos = m.k_pos.narrow(0, j0, j1 - j0);
  if (m.q_media.defined()) s.q_media = m.q_media.narrow(0, b, 1).narrow(1, i0, i1 - i0);
  if (m.kv_media.defined()) s.kv_media = m.kv_media.narrow(0, b, 1).narrow(1, j0, j1 - j0);
  if (m.kv_valid.defined()) s.kv_valid = m.kv_valid.narrow(0, b, 1).narrow(1, j0, j1 - j0);
  return s;
}

// True when queries [i0, i1) see keys [j0, j1) exactly as a top-left causal mask does (query r
// sees key c iff c <= r): causal positions p0 + r and p0 + c, no padding. Reads the host view.
bool top_left_causal(const MaskView& v, int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
  if (v.kind != static_cast<int>(MaskKind::kCausal) || v.kv_valid != nullptr) return false;
  const int64_t p0 = v.q_pos[i0];
  for (int64_t r = i0; r < i1; ++r) {
    if (v.q_pos[r] != p0 + (r - i0)) return false;
  }
  for (int64_t c = j0; c < j1; ++c) {
    if (v.k_pos[c] != p0 + (c - j0)) return false;
  }
  return true;
}

// A block that is exactly top-left causal as a whole (a ring's diagonal block, a local causal
// prefill): one is_causal call per batch row instead of calls per run, as SDPA would make.
void whole_block_if_causal(Plan& plan, const PreparedMask& pm, int64_t batch, int64_t sq,
                           int64_t skv) {
  if (plan.groups.empty() || !top_left_causal(pm.view, 0, sq, 0, skv)) return;
  plan.groups.clear();
  for (int64_t b = 0; b < batch; ++b) {
    plan.groups.push_back({b, 0, pm.n_q_tiles, {Run{0, pm.n_k_tiles, false}}});
  }
}

// The plan of a block: prepared on the host from the mask's metadata, or directly if unmasked.
std::pair<PreparedMask, Plan> plan_block(const AttentionMask& mask, int64_t batch, int64_t sq,
                                         int64_t skv) {
  if (unmasked(mask)) return plan_unmasked(batch, sq, skv);
  PreparedMask pm = prepare_mask(mask, batch, sq, skv, kCpuQTile, kCpuKTile, at::kCPU);
  Plan plan = make_plan(pm, batch);
  whole_block_if_causal(plan, pm, batch, sq, skv);
  return {std::move(pm), std::move(plan)};
}

// [1, n, Hq, D] rows of x (batch row b, tokens [i0, i0 + n)) as [1, Hkv, n, D] for query head
// gi of every K/V head group (a strided view).
at::Tensor head_view(const at::Tensor& x, int64_t b, int64_t i0, int64_t n, int64_t hkv, int64_t g,
                     int64_t gi) {
  return x.narrow(0, b, 1)
      .narrow(1, i0, n)
      .view({1, n, hkv, g, x.size(3)})
      .select(3, gi)
      .transpose(1, 2);
}
// [B, Hq, Sq] stats of batch row b, queries [i0, i0 + n), query head gi of each group: [1, Hkv, n].
at::Tensor stat_view(const at::Tensor& s, int64_t b, int64_t i0, int64_t n, int64_t hkv, int64_t g,
                     int64_t gi) {
  return s.narrow(0, b, 1).view({1, hkv, g, s.size(2)}).select(2, gi).narrow(2, i0, n);
}

// One masked or unmasked piece of a run: queries [i0, i1), keys [j0, j1).
struct Piece {
  int64_t i0, i1, j0, j1;
  bool causal;      // top-left causal: is_causal instead of a mask
  at::Tensor bias;  // [1, 1, n, m] additive mask in the input dtype, or undefined
  at::Tensor rows;  // [1, 1, n] bool: the row sees some key of the piece (masked pieces only)
};

// Cuts run `r` of group `gr` into pieces with bounded masks. `mask` is on the inputs' device
// (the bias is built there); `view` is the host copy the plan was made from. Bias rows start at
// multiples of `align` elements (the last dim is padded, then narrowed back).
std::vector<Piece> pieces(const Group& gr, const Run& r, const AttentionMask& mask,
                          const MaskView& view, int64_t sq, int64_t skv, at::ScalarType dtype,
                          int64_t align) {
  const int64_t i0 = gr.qt0 * kCpuQTile, i1 = std::min(sq, gr.qt1 * kCpuQTile);
  const int64_t j0 = r.kt0 * kCpuKTile, j1 = std::min(skv, r.kt1 * kCpuKTile);
  if (r.full) return {{i0, i1, j0, j1, false, {}, {}}};
  if (top_left_causal(view, i0, i1, j0, j1)) return {{i0, i1, j0, j1, true, {}, {}}};
  const int64_t step = std::max<int64_t>(
      kCpuQTile, kMaskElems / std::max<int64_t>(1, j1 - j0) / kCpuQTile * kCpuQTile);
  const int64_t m = j1 - j0, m_pad = (m + align - 1) / align * align;
  std::vector<Piece> out;
  for (int64_t a = i0; a < i1; a += step) {
    const int64_t e = std::min(i1, a + step);
    at::Tensor vis = mask_matrix(sub_mask(mask, gr.b, a, e, j0, j1), 1, e - a, m);
    at::Tensor bias = at::zeros({1, e - a, m_pad}, vis.options().dtype(dtype))
                          .narrow(2, 0, m)
                          .masked_fill_(vis.logical_not(), -kInf)
                          .unsqueeze(1);
    out.push_back({a, e, j0, j1, false, bias, vis.any(-1).unsqueeze(1)});
  }
  return out;
}

// The one piece that covers the whole block when the plan is one call: every batch row one run
// over all tiles, fully visible (no mask, or a mask that hides nothing) or top-left causal. Its
// outputs become lvx's without any copy for fp32 (one query head per K/V head).
std::optional<Piece> whole_piece(const Plan& plan, const PreparedMask& pm, int64_t batch,
                                 int64_t sq, int64_t skv) {
  if (plan.groups.size() != static_cast<size_t>(batch)) return std::nullopt;
  bool full = true;
  for (size_t b = 0; b < plan.groups.size(); ++b) {
    const Group& gr = plan.groups[b];
    if (gr.b != static_cast<int64_t>(b) || gr.qt0 != 0 || gr.qt1 != pm.n_q_tiles ||
        gr.runs.size() != 1)
      return std::nullopt;
    const Run& r = gr.runs.front();
    if (r.kt0 != 0 || r.kt1 != pm.n_k_tiles) return std::nullopt;
    full = full && r.full;
  }
  if (full) return Piece{0, sq, 0, skv, false, {}, {}};
  if (top_left_causal(pm.view, 0, sq, 0, skv)) return Piece{0, sq, 0, skv, true, {}, {}};
  return std::nullopt;
}

FusedCall make_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Piece& p,
                    double scale);

// x [B, S, H, D] as a call's [B, H / f, f·S, D]: the f query heads that read one K/V head side by
// side along the sequence (head h·f + i at rows i·S ..). f = 1 is a transposed view; f > 1 copies
// (a few queries: decode rows, a question's tokens).
at::Tensor fold_heads(const at::Tensor& x, int64_t f) {
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2), D = x.size(3);
  return x.view({B, S, H / f, f, D}).permute({0, 2, 3, 1, 4}).reshape({B, H / f, f * S, D});
}
// The inverse: a call's y [B, Hc, f·S, D] as [B, S, Hc·f, D].
at::Tensor unfold_heads(const at::Tensor& y, int64_t f) {
  const int64_t B = y.size(0), Hc = y.size(1), S = y.size(2) / f, D = y.size(3);
  return y.reshape({B, Hc, f, S, D}).permute({0, 3, 1, 2, 4}).reshape({B, S, Hc * f, D});
}

// How a piece's g query heads per K/V head go to the op, the same in the forward and the
// backward: one call with grouped K/V heads where the table takes it (FusedOps::grouped: flash);
// else, without a causal order among its queries, one call with the g heads folded along the
// sequence (fold_heads: a prefill chunk's or a decode step's few queries then make one call over
// the keys, not g, and the op's per-block cost is paid once); else one call per query head of
// each group (head_view).
enum class PieceForm { kGrouped, kFolded, kPerHead };
PieceForm piece_form(const FusedOps& ops, const FusedCall& grouped, int64_t g, const Piece& p) {
  if (g > 1 && ops.grouped != nullptr && ops.grouped(ops, grouped)) return PieceForm::kGrouped;
  return g > 1 && !p.causal ? PieceForm::kFolded : PieceForm::kPerHead;
}

// The whole block as one call over every head (and every batch row): with equal heads, grouped
// K/V heads where the table takes them (FusedOps::grouped: flash), or else, with no causal
// order among the queries, each K/V head's g query heads folded along the sequence (fold_heads;
// a decode step's few queries then make one call, not g), instead of one call per query head of
// each group and batch row.
struct WholeCall {
  FusedCall call;
  int64_t fold = 1;  // query heads folded along the sequence (fold_heads)
};
std::optional<WholeCall> whole_call(const FusedOps& ops, const Plan& plan, const PreparedMask& pm,
                                    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    double scale) {
  const int64_t g = q.size(2) / k.size(2);
  const auto p = whole_piece(plan, pm, q.size(0), q.size(1), k.size(1));
  if (!p) return std::nullopt;
  const at::Tensor kt = k.transpose(1, 2), vt = v.transpose(1, 2);
  FusedCall c = make_call(q.transpose(1, 2), kt, vt, *p, scale);
  if (g == 1) return WholeCall{c, 1};  // one query head per K/V head: already one call
  switch (piece_form(ops, c, g, *p)) {
    case PieceForm::kGrouped:
      return WholeCall{c, 1};
    case PieceForm::kFolded:
      return WholeCall{make_call(fold_heads(q, g), kt, vt, *p, scale), g};
    case PieceForm::kPerHead:  // causal: folded, a head's queries would follow another's
      break;
  }
  return std::nullopt;
}

void add_stats(const Plan& plan, int64_t hq, AttentionStats* stats) {
  if (stats == nullptr) return;
  stats->tiles_total += plan.total * hq;
  stats->tiles_skipped += plan.skipped * hq;
  stats->tiles_full += plan.full * hq;
  stats->tiles_fused += plan.fused * hq;
}

// The mask with its metadata on `dev` (the biases are built there; a no-op where it already is).
AttentionMask mask_on(const AttentionMask& m, const at::Device& dev) {
  AttentionMask r = m;
  for (at::Tensor* t : {&r.q_pos, &r.k_pos, &r.q_media, &r.kv_media, &r.kv_valid}) {
    if (t->defined()) *t = t->to(dev);
  }
  return r;
}

FusedCall make_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Piece& p,
                    double scale) {
  return {q, k, v, p.causal, p.bias, p.rows, scale};
}

// ops.forward(call), counting which of ATen's CUDA kernels served it (a CUDA table only: ops.sm
// > 0; the choice is the table's own, cuda_fused_kernel).
std::tuple<at::Tensor, at::Tensor> forward_call(const FusedOps& ops, const FusedCall& c,
                                                AttentionStats* stats) {
  if (stats != nullptr && ops.sm > 0) {
    const FusedKernel k = cuda_fused_kernel(c.q.scalar_type(), c.causal, c.bias.defined(),
                                            c.q.size(2), c.k.size(2), c.q.size(3), ops.sm);
    ++(k == FusedKernel::kFlash ? stats->calls_flash : stats->calls_efficient);
  }
  return ops.forward(ops, c);
}

// ---- the CPU table: at::_scaled_dot_product_flash_attention_for_cpu for every call -----------
std::optional<at::Tensor> bias_arg(const FusedCall& c) {
  return c.bias.defined() ? std::optional<at::Tensor>(c.bias) : std::nullopt;
}

std::tuple<at::Tensor, at::Tensor> cpu_forward(const FusedOps&, const FusedCall& c) {
  return at::_scaled_dot_product_flash_attention_for_cpu(c.q, c.k, c.v, 0.0, c.causal, bias_arg(c),
                                                         c.scale);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_backward(const FusedOps&, const FusedCall& c,
                                                            const at::Tensor& dout,
                                                            const at::Tensor& out,
                                                            const at::Tensor& lse) {
  return at::_scaled_dot_product_flash_attention_for_cpu_backward(
      dout, c.q, c.k, c.v, out, lse, 0.0, c.causal, bias_arg(c), c.scale);
}

// o_new [1, n, H', D] and l_new [1, H', n] fp32 into out's o_dst [1, n, H', D] and l_dst
// [1, H', n]: copied when nothing was written there yet (`fresh`), else merged.
void write_piece(const FusedOps& ops, const at::Tensor& o_new, const at::Tensor& l_new,
                 at::Tensor o_dst, at::Tensor l_dst, bool fresh) {
  if (fresh) {
    o_dst.copy_(o_new);
    l_dst.copy_(l_new);
    return;
  }
  at::Tensor os = o_dst.contiguous(), ls = l_dst.contiguous();
  ops.merge(os, ls, o_new.to(at::kFloat).contiguous(), l_new.contiguous());
  o_dst.copy_(os);
  l_dst.copy_(ls);
}

// A masked piece's lse: −inf for a row with no visible key whatever the op gave (CPU: 0; CUDA:
// −inf). `rows` [1, 1, n] bool, or undefined (every row sees a key).
at::Tensor piece_lse(const at::Tensor& lse, const at::Tensor& rows) {
  const at::Tensor l32 = lse.to(at::kFloat);
  return rows.defined() ? at::where(rows, l32, at::full_like(l32, -kInf)) : l32;
}

// bias [1, 1, n, m] repeated for f query heads folded along the sequence ([1, 1, f·n, m]), its
// rows still starting at multiples of `align` elements.
at::Tensor fold_bias(const at::Tensor& bias, int64_t f, int64_t align) {
  const int64_t n = bias.size(2), m = bias.size(3), m_pad = (m + align - 1) / align * align;
  at::Tensor out = at::empty({1, 1, f * n, m_pad}, bias.options()).narrow(3, 0, m);
  out.view({1, 1, f, n, m}).copy_(bias.unsqueeze(2).expand({1, 1, f, n, m}));
  return out;
}

// A piece's views of batch row b: its queries [1, rows, Hq, D] and keys/values [1, Hkv, m, D].
struct PieceInputs {
  at::Tensor qb, kg, vg;
  int64_t rows, hkv, g;
};
PieceInputs piece_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t b,
                         const Piece& p) {
  const int64_t rows = p.i1 - p.i0, m = p.j1 - p.j0, hkv = k.size(2);
  return {q.narrow(0, b, 1).narrow(1, p.i0, rows),
          k.narrow(0, b, 1).narrow(1, p.j0, m).transpose(1, 2),
          v.narrow(0, b, 1).narrow(1, p.j0, m).transpose(1, 2),
          rows,
          hkv,
          q.size(2) / hkv};
}

// The folded form's piece: its bias and rows repeated once per folded query head.
Piece folded_piece(const Piece& p, int64_t g, int64_t align) {
  Piece f = p;
  if (p.bias.defined()) f.bias = fold_bias(p.bias, g, align);
  if (p.rows.defined()) f.rows = p.rows.repeat({1, 1, g});
  return f;
}

// One piece of batch row b through the op (piece_form), merged into `out`.
void forward_piece(const FusedOps& ops, const at::Tensor& q, const at::Tensor& k,
                   const at::Tensor& v, int64_t b, const Piece& p, double scale, bool fresh,
                   AttentionOutput& out, AttentionStats* stats) {
  const PieceInputs in = piece_inputs(q, k, v, b, p);
  const int64_t rows = in.rows, hkv = in.hkv, g = in.g;
  const FusedCall grouped = make_call(in.qb.transpose(1, 2), in.kg, in.vg, p, scale);
  at::Tensor o_dst = out.o.narrow(0, b, 1).narrow(1, p.i0, rows);
  at::Tensor l_dst = out.lse.narrow(0, b, 1).narrow(2, p.i0, rows);
  switch (piece_form(ops, grouped, g, p)) {
    case PieceForm::kGrouped: {
      auto [o, lse] = forward_call(ops, grouped, stats);
      write_piece(ops, o.transpose(1, 2), piece_lse(lse, p.rows), o_dst, l_dst, fresh);
      return;
    }
    case PieceForm::kFolded: {
      const Piece f = folded_piece(p, g, ops.bias_align);
      auto [o, lse] =
          forward_call(ops, make_call(fold_heads(in.qb, g), in.kg, in.vg, f, scale), stats);
      write_piece(ops, unfold_heads(o, g), piece_lse(lse, f.rows).reshape({1, hkv * g, rows}),
                  o_dst, l_dst, fresh);
      return;
    }
    case PieceForm::kPerHead:
      break;
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    auto [o, lse] = forward_call(
        ops, make_call(head_view(q, b, p.i0, rows, hkv, g, gi), in.kg, in.vg, p, scale), stats);
    write_piece(ops, o.transpose(1, 2), piece_lse(lse, p.rows),
                head_view(out.o, b, p.i0, rows, hkv, g, gi).transpose(1, 2),
                stat_view(out.lse, b, p.i0, rows, hkv, g, gi), fresh);
  }
}

// The backward's per-row inputs beside q: dout, O' (o_fake) and the lse (+inf where a row sees
// nothing), all [B, Sq, Hq, D] / [B, Hq, Sq].
struct BackwardRows {
  const at::Tensor &dout, &o_fake, &lse;
};

// One piece's gradients (the forward's calls again: piece_form), added into `grads`.
void backward_piece(const FusedOps& ops, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, const BackwardRows& br, int64_t b, const Piece& p,
                    double scale, AttentionGrads& grads) {
  const PieceInputs in = piece_inputs(q, k, v, b, p);
  const int64_t rows = in.rows, hkv = in.hkv, g = in.g, m = p.j1 - p.j0;
  const FusedCall grouped = make_call(in.qb.transpose(1, 2), in.kg, in.vg, p, scale);
  const at::Tensor d_b = br.dout.narrow(0, b, 1).narrow(1, p.i0, rows);
  const at::Tensor o_b = br.o_fake.narrow(0, b, 1).narrow(1, p.i0, rows);
  const at::Tensor l_b = br.lse.narrow(0, b, 1).narrow(2, p.i0, rows);
  auto add_kv = [&](const at::Tensor& gk, const at::Tensor& gv) {
    grads.dk.narrow(0, b, 1).narrow(1, p.j0, m).add_(gk.transpose(1, 2));
    grads.dv.narrow(0, b, 1).narrow(1, p.j0, m).add_(gv.transpose(1, 2));
  };
  at::Tensor dq_b = grads.dq.narrow(0, b, 1).narrow(1, p.i0, rows);
  switch (piece_form(ops, grouped, g, p)) {
    case PieceForm::kGrouped: {
      auto [gq, gk, gv] =
          ops.backward(ops, grouped, d_b.transpose(1, 2), o_b.transpose(1, 2), l_b.contiguous());
      dq_b.add_(gq.transpose(1, 2));
      add_kv(gk, gv);
      return;
    }
    case PieceForm::kFolded: {
      const Piece f = folded_piece(p, g, ops.bias_align);
      auto [gq, gk, gv] =
          ops.backward(ops, make_call(fold_heads(in.qb, g), in.kg, in.vg, f, scale),
                       fold_heads(d_b, g), fold_heads(o_b, g), l_b.reshape({1, hkv, g * rows}));
      dq_b.add_(unfold_heads(gq, g));
      add_kv(gk, gv);
      return;
    }
    case PieceForm::kPerHead:
      break;
  }
  for (int64_t gi = 0; gi < g; ++gi) {
    auto [gq, gk, gv] = ops.backward(
        ops, make_call(head_view(q, b, p.i0, rows, hkv, g, gi), in.kg, in.vg, p, scale),
        head_view(br.dout, b, p.i0, rows, hkv, g, gi),
        head_view(br.o_fake, b, p.i0, rows, hkv, g, gi),
        stat_view(br.lse, b, p.i0, rows, hkv, g, gi).contiguous());
    head_view(grads.dq, b, p.i0, rows, hkv, g, gi).add_(gq);
    add_kv(gk, gv);
  }
}

}  // namespace

const FusedOps& cpu_fused_ops() {
  static const FusedOps ops{"cpu", cpu_forward, cpu_backward, merge_attention_states_cpu, 1, 0};
  return ops;
}

bool cpu_uses_fused_path(at::ScalarType dtype) {
  return cpu_attention_path(dtype, 1, 1) == CpuPath::kFused;
}

AttentionOutput attention_forward_fused(const FusedOps& ops, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v, double scale,
                                        const AttentionMask& mask, AttentionStats* stats) {
  const int64_t batch = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t skv = k.size(1);
  const auto f32 = q.options().dtype(at::kFloat);
  if (sq == 0 || skv == 0) {
    return {at::zeros({batch, sq, hq, d}, f32), at::full({batch, hq, sq}, -kInf, f32)};
  }
  const auto [pm, plan] = plan_block(mask, batch, sq, skv);
  add_stats(plan, hq, stats);
  if (const auto w = whole_call(ops, plan, pm, q, k, v, scale)) {
    auto [o, lse] = forward_call(ops, w->call, stats);
    return {unfold_heads(o, w->fold).to(at::kFloat).contiguous(),
            lse.reshape({batch, hq, sq}).to(at::kFloat).contiguous()};
  }
  const AttentionMask dmask = mask_on(mask, q.device());
  AttentionOutput out{at::zeros({batch, sq, hq, d}, f32), at::full({batch, hq, sq}, -kInf, f32)};
  // Every piece's result merges into o/lse in fp32; a piece whose query tiles nothing has
  // written yet is copied in directly.
  std::vector<char> written(batch * pm.n_q_tiles, 0);
  for (const Group& gr : plan.groups) {
    for (const Run& r : gr.runs) {
      for (const Piece& p :
           pieces(gr, r, dmask, pm.view, sq, skv, q.scalar_type(), ops.bias_align)) {
        const int64_t t0 = p.i0 / kCpuQTile, t1 = (p.i1 + kCpuQTile - 1) / kCpuQTile;
        char* w = written.data() + gr.b * pm.n_q_tiles;
        const bool fresh = std::none_of(w + t0, w + t1, [](char x) { return x != 0; });
        std::fill(w + t0, w + t1, 1);
        forward_piece(ops, q, k, v, gr.b, p, scale, fresh, out, stats);
      }
    }
  }
  return out;
}

AttentionGrads attention_backward_fused(const FusedOps& ops, const at::Tensor& q,
                                        const at::Tensor& k, const at::Tensor& v,
                                        const at::Tensor& dout, const at::Tensor& lse,
                                        const at::Tensor& delta, double scale,
                                        const AttentionMask& mask, AttentionStats* stats) {
  const int64_t batch = q.size(0), sq = q.size(1), hq = q.size(2);
  const int64_t skv = k.size(1);
  const auto f32 = q.options().dtype(at::kFloat);
  if (sq == 0 || skv == 0) {
    return {at::zeros(q.sizes(), f32), at::zeros(k.sizes(), f32), at::zeros(v.sizes(), f32)};
  }
  const auto [pm, plan] = plan_block(mask, batch, sq, skv);
  add_stats(plan, hq, stats);
  // Rows that see no key anywhere have lse = −inf: +inf makes P = exp(S − lse) = 0 there.
  const at::Tensor lse_p = at::where(lse.isneginf(), at::full_like(lse, kInf), lse).contiguous();
  // O' with rowsum(dO ∘ O') = delta, in the input dtype ([B, Sq, Hq, D]).
  const at::Tensor do32 = dout.to(at::kFloat);
  const at::Tensor den = at::linalg_vector_norm(do32, 2, {-1}, true).square_();  // one read of dO
  const at::Tensor coef = at::where(den.gt(0),
                                    delta.transpose(1, 2).unsqueeze(-1).to(at::kFloat) /
                                        at::where(den.gt(0), den, at::ones_like(den)),
                                    at::zeros_like(den));
  const at::Tensor o_fake = (do32 * coef).to(q.scalar_type()).contiguous();
  if (const auto w = whole_call(ops, plan, pm, q, k, v, scale)) {
    const int64_t f = w->fold;
    auto [gq, gk, gv] = ops.backward(ops, w->call, fold_heads(dout, f), fold_heads(o_fake, f),
                                     lse_p.view({batch, hq / f, f * sq}));
    return {unfold_heads(gq, f).to(at::kFloat).contiguous(),
            gk.transpose(1, 2).to(at::kFloat).contiguous(),
            gv.transpose(1, 2).to(at::kFloat).contiguous()};
  }
  const AttentionMask dmask = mask_on(mask, q.device());
  AttentionGrads grads{at::zeros(q.sizes(), f32), at::zeros(k.sizes(), f32),
                       at::zeros(v.sizes(), f32)};
  const BackwardRows br{dout, o_fake, lse_p};
  for (const Group& gr : plan.groups) {
    for (const Run& r : gr.runs) {
      for (const Piece& p : pieces(gr, r, dmask, pm.view, sq, skv, q.scalar_type(), ops.bias_align))
        backward_piece(ops, q, k, v, br, gr.b, p, scale, grads);
    }
  }
  return grads;
}

AttentionOutput attention_forward_dispatch_cpu(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, double scale,
                                               const AttentionMask& mask, AttentionStats* stats) {
  switch (cpu_attention_path(q.scalar_type(), q.size(1), k.size(1))) {
    case CpuPath::kFused:
      return attention_forward_fused(cpu_fused_ops(), q, k, v, scale, mask, stats);
    case CpuPath::kGemm:
      return attention_forward_gemm(q, k, v, scale, mask, stats);
    case CpuPath::kKernel:
      break;
  }
  return attention_forward_cpu(q, k, v, scale, mask, stats);
}

AttentionGrads attention_backward_dispatch_cpu(const at::Tensor& q, const at::Tensor& k,
                                               const at::Tensor& v, const at::Tensor& dout,
                                               const at::Tensor& lse, const at::Tensor& delta,
                                               double scale, const AttentionMask& mask,
                                               AttentionStats* stats) {
  switch (cpu_attention_path(q.scalar_type(), q.size(1), k.size(1))) {
    case CpuPath::kFused:
      return attention_backward_fused(cpu_fused_ops(), q, k, v, dout, lse, delta, scale, mask,
                                      stats);
    case CpuPath::kGemm:
      return attention_backward_gemm(q, k, v, dout, lse, delta, scale, mask, stats);
    case CpuPath::kKernel:
      break;
  }
  return attention_backward_cpu(q, k, v, dout, lse, delta, scale, mask, stats);
}

}  // namespace lvx::kernels
