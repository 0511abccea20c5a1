// CPU blockwise attention forward: FlashAttention-2 online softmax (Dao 2023, Alg. 1; NOTES.md
// §0, BurstAttention Alg. 1 inside one rank) over (query tile x key tile) pairs. One score tile
// per task is alive at a time; tiles are multiplied with ATen's BLAS matmul in the accumulation
// dtype; tiles without a visible entry are skipped from per-tile metadata bounds.
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

// Sets invisible entries of a [tq, tk] score tile (row stride ld) to -inf.
template <typename T>
void apply_mask(const MaskView& m, int64_t b, int64_t i0, int64_t tq, int64_t j0, int64_t tk, T* s,
                int64_t ld) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < tq; ++r) {
    T* row = s + r * ld;
    for (int64_t c = 0; c < tk; ++c) {
      if (!m.visible(b, i0 + r, j0 + c)) row[c] = neg_inf;
    }
  }
}

// One forward call: its sizes and inputs, and the raw outputs o ([B, Sq, Hq, D]) and lse ([B, Hq,
// Sq]), contiguous in the accumulation dtype T (acc).
template <typename T>
struct FwdCall : CallSizes {
  const at::Tensor& q;
  const at::Tensor& k;
  const at::Tensor& v;
  const at::Tensor& o;
  const PreparedMask& pm;
  double scale;
  at::ScalarType acc;
  T* o_ptr;
  T* lse_ptr;
};

// Where one task's query tile lies: batch b, query head h (of K/V head hk), rows [i0, i0 + tq).
struct QTilePos {
  int64_t b, h, hk, i0, tq;
};

// The online-softmax state of one query tile: the unnormalized output acc_o [tq, d] and each
// row's running max m and sum l.
template <typename T>
struct FwdRows {
  at::Tensor acc_o;
  std::vector<T> m, l;
};

// The tile counts of one call, added to by every task.
struct TileCounts {
  std::atomic<int64_t> total{0}, skipped{0}, full{0};
};

// Online softmax before exp on a [tq, tk] score tile sp: each row's new max m_new, S - m_new, and
// the running sum and output rescaled by exp(m - m_new) (a row with nothing visible yet stays).
template <typename T>
inline void rescale_to_new_max(T* sp, int64_t tq, int64_t tk, int64_t d, FwdRows<T>& rows) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  at::Tensor& acc_o = rows.acc_o;
  std::vector<T>& m = rows.m;
  std::vector<T>& l = rows.l;
  T* ap = acc_o.data_ptr<T>();
  for (int64_t r = 0; r < tq; ++r) {
    T* row = sp + r * tk;
    T mt = neg_inf;
    for (int64_t c = 0; c < tk; ++c) mt = std::max(mt, row[c]);
    const T m_new = std::max(m[r], mt);
    if (m_new == neg_inf) continue;          // nothing visible yet: row stays -inf, P = 0
    const T alpha = std::exp(m[r] - m_new);  // m = -inf -> 0 (acc is 0 then)
    for (int64_t c = 0; c < tk; ++c) row[c] -= m_new;
    if (alpha != T(1)) {
      l[r] *= alpha;
      for (int64_t x = 0; x < d; ++x) ap[r * d + x] *= alpha;
    }
    m[r] = m_new;
  }
}

// Adds each row's sum of a [tq, tk] tile of P to its running sum l.
template <typename T>
inline void add_row_sums(const T* sp, int64_t tq, int64_t tk, std::vector<T>& l) {
  for (int64_t r = 0; r < tq; ++r) {
    const T* row = sp + r * tk;
    T sum = 0;
    for (int64_t c = 0; c < tk; ++c) sum += row[c];
    l[r] += sum;
  }
}

// Key tile kt (visibility vis) for one query tile: S = q_tile·Kᵀ, masked when partial (else
// counted in n_full), then the online-softmax update of rows with P = exp(S - m_new) and P·V.
template <typename T>
inline void attend_key_tile(const FwdCall<T>& call, const QTilePos& t, int64_t kt,
                            TileVisibility vis, const at::Tensor& q_tile, FwdRows<T>& rows,
                            int64_t& n_full) {
  const int64_t j0 = kt * kKTile, tk = std::min(kKTile, call.skv - j0);
  at::Tensor k_tile = call.k.select(0, t.b).select(1, t.hk).narrow(0, j0, tk).to(call.acc);
  at::Tensor v_tile = call.v.select(0, t.b).select(1, t.hk).narrow(0, j0, tk).to(call.acc);
  at::Tensor s = at::mm(q_tile, k_tile.t());  // [tq, tk], contiguous
  T* sp = s.data_ptr<T>();
  if (vis == TileVisibility::kPartial) {
    apply_mask(call.pm.view, t.b, t.i0, t.tq, j0, tk, sp, tk);
  } else {
    ++n_full;
  }
  // Online softmax: rescale the running state to the new row max, P = exp(S - m_new).
  rescale_to_new_max(sp, t.tq, tk, call.d, rows);
  s.exp_();  // exp(-inf) = 0 for masked entries and still-empty rows
  add_row_sums(sp, t.tq, tk, rows.l);
  rows.acc_o.addmm_(s, v_tile);
}

// The write-back of one query tile: O = acc_o / l into o and lse = m + log(l); an empty row
// (l = 0) gets O = 0 and lse = -inf.
template <typename T>
inline void write_query_tile(const FwdCall<T>& call, const QTilePos& t, const FwdRows<T>& rows) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t b = t.b, h = t.h, i0 = t.i0, tq = t.tq;
  const int64_t sq = call.sq, hq = call.hq, d = call.d;
  T* o_ptr = call.o_ptr;
  T* lse_ptr = call.lse_ptr;
  const at::Tensor& acc_o = rows.acc_o;
  const std::vector<T>& m = rows.m;
  const std::vector<T>& l = rows.l;
  const T* ap = acc_o.data_ptr<T>();
  for (int64_t r = 0; r < tq; ++r) {
    T* out = o_ptr + ((b * sq + i0 + r) * hq + h) * d;
    const bool empty = !(l[r] > T(0));
    const T inv = empty ? T(0) : T(1) / l[r];
    for (int64_t x = 0; x < d; ++x) out[x] = ap[r * d + x] * inv;
    lse_ptr[(b * hq + h) * sq + i0 + r] = empty ? neg_inf : m[r] + std::log(l[r]);
  }
}

// One task: query tile qt of head h of batch b (task = (b·Hq + h)·n_qt + qt) against every
// visible key tile, written to o and lse.
template <typename T>
inline void forward_task(const FwdCall<T>& call, int64_t task, TileCounts& counts) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const int64_t n_qt = call.n_qt, hq = call.hq;
  const int64_t qt = task % n_qt, h = (task / n_qt) % hq, b = task / (n_qt * hq);
  const int64_t hk = h / call.group;
  const int64_t i0 = qt * kQTile, tq = std::min(kQTile, call.sq - i0);
  const QTilePos t{b, h, hk, i0, tq};
  const TileSummary qs = call.pm.q_summary(b, qt);
  at::Tensor q_tile =
      call.q.select(0, b).select(1, h).narrow(0, i0, tq).to(call.acc).mul(call.scale);
  FwdRows<T> rows{at::zeros({tq, call.d}, call.o.options()), std::vector<T>(tq, neg_inf),
                  std::vector<T>(tq, T(0))};
  int64_t n_skip = 0, n_full = 0;
  for (int64_t kt = 0; kt < call.n_kt; ++kt) {
    const auto vis =
        classify_tile(call.pm.view.kind, call.pm.view.rule, qs, call.pm.k_summary(b, kt));
    if (vis == TileVisibility::kNone) {
      ++n_skip;
      continue;
    }
    attend_key_tile(call, t, kt, vis, q_tile, rows, n_full);
  }
  write_query_tile(call, t, rows);
  counts.total += call.n_kt;
  counts.skipped += n_skip;
  counts.full += n_full;
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
void forward_cpu_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                       const PreparedMask& pm, at::Tensor& o, at::Tensor& lse,
                       AttentionStats* stats) {
  const auto acc = o.scalar_type();
  T* o_ptr = o.data_ptr<T>();
  T* lse_ptr = lse.data_ptr<T>();
  const FwdCall<T> call{call_sizes(q, k, pm), q, k, v, o, pm, scale, acc, o_ptr, lse_ptr};
  TileCounts counts;
  // Tasks of less than ~4 MFLOP are grouped so tiny calls stay on one thread (a parallel
  // region costs more than they do, and far more when the cores are oversubscribed).
  const int64_t task_flops = 4 * std::min(call.sq, kQTile) * call.skv * call.d;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 22) / std::max<int64_t>(1, task_flops));
  at::parallel_for(0, call.batch * call.hq * call.n_qt, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) forward_task(call, task, counts);
  });
  add_stats(counts, stats);
}

}  // namespace

AttentionOutput attention_forward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      double scale, const AttentionMask& mask,
                                      AttentionStats* stats) {
  const int64_t batch = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
  const auto acc = accumulation_dtype(q.scalar_type());
  auto opts = q.options().dtype(acc);
  AttentionOutput out{at::empty({batch, sq, hq, d}, opts), at::empty({batch, hq, sq}, opts)};
  if (k.size(1) == 0) {  // no keys: every row is empty
    out.o.zero_();
    out.lse.fill_(-std::numeric_limits<double>::infinity());
  }
  if (sq == 0 || k.size(1) == 0) return out;
  const PreparedMask pm = prepare_mask(mask, batch, sq, k.size(1), kQTile, kKTile, at::kCPU);
  if (acc == at::kDouble) {
    forward_cpu_typed<double>(q, k, v, scale, pm, out.o, out.lse, stats);
  } else {
    forward_cpu_typed<float>(q, k, v, scale, pm, out.o, out.lse, stats);
  }
  return out;
}

}  // namespace lvx::kernels
