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

// How each (batch, K/V head)'s key tiles are split into tasks: chunks of kt_per_chunk tiles, and
// dq_parts [chunks, B, Sq, Hq, D] for each chunk's dQ (g.dq itself when chunks == 1).
struct KeyChunks {
  int64_t chunks, kt_per_chunk;
  at::Tensor dq_parts;
};

// Chunks > 1 only when batch x K/V heads is below the thread count; each chunk then adds into its
// own zeroed dQ copy.
KeyChunks key_chunks(const CallSizes& z, const AttentionGrads& g) {
  const int64_t threads = at::get_num_threads();
  const int64_t chunks =
      std::max<int64_t>(1, std::min(z.n_kt, (threads + z.batch * z.hkv - 1) / (z.batch * z.hkv)));
  const int64_t kt_per_chunk = (z.n_kt + chunks - 1) / chunks;
  at::Tensor dq_parts = chunks == 1 ? g.dq.unsqueeze(0)
                                    : at::zeros({chunks, z.batch, z.sq, z.hq, z.d}, g.dq.options());
  return KeyChunks{chunks, kt_per_chunk, dq_parts};
}

// One backward call: its sizes, key chunks and inputs, the gradients g (accumulation dtype T,
// acc) and the raw lse and delta ([B, Hq, Sq]).
template <typename T>
struct BwdCall : CallSizes, KeyChunks {
  const at::Tensor& q;
  const at::Tensor& k;
  const at::Tensor& v;
  const at::Tensor& dout;
  const PreparedMask& pm;
  AttentionGrads& g;
  double scale;
  at::ScalarType acc;
  const T* lse_ptr;
  const T* delta_ptr;
};

// One key tile of one task: keys [j0, j0 + tk) of K/V head hk of batch b in the accumulation
// dtype, and its dK/dV sums over every query tile of the head group.
struct BwdKeyTile {
  int64_t b, hk, j0, tk;
  at::Tensor k_tile, v_tile, dk_acc, dv_acc;
};

// The tile counts of one task.
struct TaskTally {
  int64_t total = 0, skip = 0, full = 0;
};

// The tile counts of one call, added to by every task.
struct TileCounts {
  std::atomic<int64_t> total{0}, skipped{0}, full{0};
};

// Sets invisible entries of a [tq, tk] score tile pp to -inf.
template <typename T>
inline void mask_scores(const MaskView& m, int64_t b, int64_t i0, int64_t tq, int64_t j0,
                        int64_t tk, T* pp) {
  const T inf = std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < tq; ++r) {
    for (int64_t x = 0; x < tk; ++x) {
      if (!m.visible(b, i0 + r, j0 + x)) pp[r * tk + x] = -inf;
    }
  }
}

// S - lse, row by row, on a [tq, tk] score tile pp (lse_row: the tile's rows of lse).
template <typename T>
inline void subtract_lse(const T* lse_row, int64_t tq, int64_t tk, T* pp) {
  const T inf = std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < tq; ++r) {
    // A row that sees no key anywhere has lse = -inf: use +inf so P = exp(S - inf) = 0
    // instead of exp(-inf + inf) = NaN (+inf is already the flash-attn convention).
    const T l = lse_row[r] == -inf ? inf : lse_row[r];
    for (int64_t x = 0; x < tk; ++x) pp[r * tk + x] -= l;
  }
}

// dS = P ∘ (dP - delta) in place of the [tq, tk] tile dP (dsp); 0 wherever P is 0.
template <typename T>
inline void dp_to_ds(const T* pp, const T* delta_row, int64_t tq, int64_t tk, T* dsp) {
  for (int64_t r = 0; r < tq; ++r) {
    const T dl = delta_row[r];
    for (int64_t x = 0; x < tk; ++x) {
      const T pv = pp[r * tk + x];
      dsp[r * tk + x] = pv == T(0) ? T(0) : pv * (dsp[r * tk + x] - dl);
    }
  }
}

// One visible block (query tile qt of head h, key tile key): P = exp(S - lse), masked when
// partial (else counted in n_full); dV += Pᵀ·dO, dK += dSᵀ·(scale·Q) and dQ rows += scale·dS·K.
template <typename T>
inline void backward_block(const BwdCall<T>& call, BwdKeyTile& key, int64_t h, int64_t qt,
                           TileVisibility vis, at::Tensor& dq_b, int64_t& n_full) {
  const int64_t b = key.b, j0 = key.j0, tk = key.tk, hq = call.hq, sq = call.sq;
  const int64_t i0 = qt * kQTile, tq = std::min(kQTile, sq - i0);
  at::Tensor q_tile =
      call.q.select(0, b).select(1, h).narrow(0, i0, tq).to(call.acc).mul(call.scale);
  at::Tensor do_tile = call.dout.select(0, b).select(1, h).narrow(0, i0, tq).to(call.acc);
  at::Tensor p = at::mm(q_tile, key.k_tile.t());  // S, then P in place
  T* pp = p.data_ptr<T>();
  if (vis == TileVisibility::kPartial) {
    mask_scores(call.pm.view, b, i0, tq, j0, tk, pp);
  } else {
    ++n_full;
  }
  const T* lse_row = call.lse_ptr + (b * hq + h) * sq + i0;
  const T* delta_row = call.delta_ptr + (b * hq + h) * sq + i0;
  subtract_lse(lse_row, tq, tk, pp);
  p.exp_();
  key.dv_acc.addmm_(p.t(), do_tile);
  at::Tensor ds = at::mm(do_tile, key.v_tile.t());  // dP, then dS in place
  dp_to_ds(pp, delta_row, tq, tk, ds.data_ptr<T>());
  key.dk_acc.addmm_(ds.t(), q_tile);  // q_tile carries the scale
  at::Tensor dq_rows = dq_b.select(1, h).narrow(0, i0, tq);
  dq_rows.addmm_(ds, key.k_tile, 1.0, call.scale);
}

// Loads key tile kt of K/V head hk of batch b in the accumulation dtype, with zeroed dK/dV sums.
template <typename T>
inline BwdKeyTile load_key_tile(const BwdCall<T>& call, int64_t b, int64_t hk, int64_t kt) {
  const int64_t j0 = kt * kKTile, tk = std::min(kKTile, call.skv - j0);
  at::Tensor k_tile = call.k.select(0, b).select(1, hk).narrow(0, j0, tk).to(call.acc);
  at::Tensor v_tile = call.v.select(0, b).select(1, hk).narrow(0, j0, tk).to(call.acc);
  at::Tensor dk_acc = at::zeros({tk, call.d}, call.g.dk.options());
  at::Tensor dv_acc = at::zeros({tk, call.d}, call.g.dv.options());
  return BwdKeyTile{b, hk, j0, tk, k_tile, v_tile, dk_acc, dv_acc};
}

// Writes a key tile's dK/dV sums to its rows of g.dk and g.dv (this task owns them).
template <typename T>
inline void write_key_tile(const BwdCall<T>& call, const BwdKeyTile& key) {
  call.g.dk.select(0, key.b).select(1, key.hk).narrow(0, key.j0, key.tk).copy_(key.dk_acc);
  call.g.dv.select(0, key.b).select(1, key.hk).narrow(0, key.j0, key.tk).copy_(key.dv_acc);
}

// Key tile kt of K/V head hk of batch b against every visible block of its head group (dQ into
// dq_b), then its dK/dV written to g.
template <typename T>
inline void backward_key_tile(const BwdCall<T>& call, int64_t b, int64_t hk, int64_t kt,
                              at::Tensor& dq_b, TaskTally& n) {
  const TileSummary ks = call.pm.k_summary(b, kt);
  BwdKeyTile key = load_key_tile(call, b, hk, kt);
  for (int64_t h = hk * call.group; h < (hk + 1) * call.group; ++h) {
    for (int64_t qt = 0; qt < call.n_qt; ++qt) {
      ++n.total;
      const auto vis =
          classify_tile(call.pm.view.kind, call.pm.view.rule, call.pm.q_summary(b, qt), ks);
      if (vis == TileVisibility::kNone) {
        ++n.skip;
        continue;
      }
      backward_block(call, key, h, qt, vis, dq_b, n.full);
    }
  }
  write_key_tile(call, key);
}

// One task: the key tiles of chunk c of K/V head hk of batch b (task = (b·Hkv + hk)·chunks + c),
// its dQ added into dq_parts[c].
template <typename T>
inline void backward_task(const BwdCall<T>& call, int64_t task, TileCounts& counts) {
  const int64_t chunks = call.chunks, hkv = call.hkv;
  const int64_t c = task % chunks, hk = (task / chunks) % hkv, b = task / (chunks * hkv);
  at::Tensor dq_b = call.dq_parts.select(0, c).select(0, b);  // [Sq, Hq, D]
  const int64_t kt_end = std::min(call.n_kt, (c + 1) * call.kt_per_chunk);
  TaskTally n;
  for (int64_t kt = c * call.kt_per_chunk; kt < kt_end; ++kt) {
    backward_key_tile(call, b, hk, kt, dq_b, n);
  }
  counts.total += n.total;
  counts.skipped += n.skip;
  counts.full += n.full;
}

// Adds one call's tile counts to *stats, when given.
void add_stats(const TileCounts& counts, AttentionStats* stats) {
  if (stats != nullptr) {
    stats->tiles_total += counts.total;
    stats->tiles_skipped += counts.skipped;
    stats->tiles_full += counts.full;
  }
}

template <typename T>
void backward_cpu_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& dout, const at::Tensor& lse, const at::Tensor& delta,
                        double scale, const PreparedMask& pm, AttentionGrads& g,
                        AttentionStats* stats) {
  const CallSizes z = call_sizes(q, k, pm);
  const auto acc = g.dk.scalar_type();
  const KeyChunks split = key_chunks(z, g);
  const T* lse_ptr = lse.data_ptr<T>();
  const T* delta_ptr = delta.data_ptr<T>();
  const BwdCall<T> call{z, split, q, k, v, dout, pm, g, scale, acc, lse_ptr, delta_ptr};
  TileCounts counts;
  // Tasks of less than ~4 MFLOP are grouped so tiny calls stay on one thread.
  const int64_t task_flops =
      8 * call.group * call.sq * std::min(call.skv, call.kt_per_chunk * kKTile) * call.d;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 22) / std::max<int64_t>(1, task_flops));
  at::parallel_for(0, call.batch * call.hkv * call.chunks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) backward_task(call, task, counts);
  });
  if (call.chunks > 1) at::sum_out(g.dq, call.dq_parts, {0});
  add_stats(counts, stats);
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
