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

template <typename T>
void forward_cpu_typed(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                       const PreparedMask& pm, at::Tensor& o, at::Tensor& lse,
                       AttentionStats* stats) {
  const int64_t batch = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t skv = k.size(1), hkv = k.size(2), group = hq / hkv;
  const auto acc = o.scalar_type();
  const int64_t n_qt = pm.n_q_tiles, n_kt = pm.n_k_tiles;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  T* o_ptr = o.data_ptr<T>();
  T* lse_ptr = lse.data_ptr<T>();
  std::atomic<int64_t> total{0}, skipped{0}, full{0};

  // Tasks of less than ~4 MFLOP are grouped so tiny calls stay on one thread (a parallel
  // region costs more than they do, and far more when the cores are oversubscribed).
  const int64_t task_flops = 4 * std::min(sq, kQTile) * skv * d;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 22) / std::max<int64_t>(1, task_flops));
  at::parallel_for(0, batch * hq * n_qt, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t qt = task % n_qt, h = (task / n_qt) % hq, b = task / (n_qt * hq);
      const int64_t hk = h / group;
      const int64_t i0 = qt * kQTile, tq = std::min(kQTile, sq - i0);
      const TileSummary qs = pm.q_summary(b, qt);
      at::Tensor q_tile = q.select(0, b).select(1, h).narrow(0, i0, tq).to(acc).mul(scale);
      at::Tensor acc_o = at::zeros({tq, d}, o.options());
      std::vector<T> m(tq, neg_inf), l(tq, T(0));
      int64_t n_skip = 0, n_full = 0;
      for (int64_t kt = 0; kt < n_kt; ++kt) {
        const auto vis = classify_tile(pm.view.kind, pm.view.rule, qs, pm.k_summary(b, kt));
        if (vis == TileVisibility::kNone) {
          ++n_skip;
          continue;
        }
        const int64_t j0 = kt * kKTile, tk = std::min(kKTile, skv - j0);
        at::Tensor k_tile = k.select(0, b).select(1, hk).narrow(0, j0, tk).to(acc);
        at::Tensor v_tile = v.select(0, b).select(1, hk).narrow(0, j0, tk).to(acc);
        at::Tensor s = at::mm(q_tile, k_tile.t());  // [tq, tk], contiguous
        T* sp = s.data_ptr<T>();
        if (vis == TileVisibility::kPartial) {
          apply_mask(pm.view, b, i0, tq, j0, tk, sp, tk);
        } else {
          ++n_full;
        }
        // Online softmax: rescale the running state to the new row max, P = exp(S - m_new).
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
        s.exp_();  // exp(-inf) = 0 for masked entries and still-empty rows
        for (int64_t r = 0; r < tq; ++r) {
          const T* row = sp + r * tk;
          T sum = 0;
          for (int64_t c = 0; c < tk; ++c) sum += row[c];
          l[r] += sum;
        }
        acc_o.addmm_(s, v_tile);
      }
      const T* ap = acc_o.data_ptr<T>();
      for (int64_t r = 0; r < tq; ++r) {
        T* out = o_ptr + ((b * sq + i0 + r) * hq + h) * d;
        const bool empty = !(l[r] > T(0));
        const T inv = empty ? T(0) : T(1) / l[r];
        for (int64_t x = 0; x < d; ++x) out[x] = ap[r * d + x] * inv;
        lse_ptr[(b * hq + h) * sq + i0 + r] = empty ? neg_inf : m[r] + std::log(l[r]);
      }
      total += n_kt;
      skipped += n_skip;
      full += n_full;
    }
  });
  if (stats != nullptr) {
    stats->tiles_total += total;
    stats->tiles_skipped += skipped;
    stats->tiles_full += full;
  }
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
