// all_gather: gather the full K and V on every rank (ring all-gather), attend the local queries
// to them, and in backward reduce-scatter the fp32 dK/dV partials back to their owners
// (pairwise all-to-all, then a local sum) — Llama-3-style context parallelism (anchors A9).
// The gathered K/V are kept from forward for backward (memory for communication).
#include "src/attention/strategy.h"
#include "src/common/error.h"

namespace lvx::attention {
namespace {

class AllGatherStrategy : public Strategy {
 public:
  StrategyKind kind() const override { return StrategyKind::kAllGather; }

  // [B, S_r, H, D] → [B, S, H, D] gathered along the sequence.
  static at::Tensor gather_seq(dist::ProcessGroup& pg, const at::Tensor& x,
                               const std::vector<int64_t>& sizes) {
    return pg.all_gather(x.transpose(0, 1).contiguous(), sizes).transpose(0, 1).contiguous();
  }

  LocalOutput forward(dist::ProcessGroup& pg, const AttentionSpec& s,
                      const LocalInputs& in) override {
    const int n = pg.world_size();
    const auto ks = kv_layout(s, n).sizes();
    k_full_ = gather_seq(pg, in.k, ks);
    v_full_ = gather_seq(pg, in.v, ks);
    const at::Tensor q_pos = q_layout(s, n).positions(pg.rank());
    if (in.q.size(1) == 0) {
      const auto acc = kernels::accumulation_dtype(in.q.scalar_type());
      return {at::zeros(in.q.sizes(), in.q.options().dtype(acc)),
              at::empty({s.batch, s.hq, 0}, in.q.options().dtype(acc))};
    }
    auto res = kernels::attention_forward(in.q, k_full_, v_full_,
                                          block_params(s, in, q_pos, at::arange(s.skv, at::kLong)));
    return {res.o, res.lse};
  }

  LocalGrads backward(dist::ProcessGroup& pg, const AttentionSpec& s, const LocalInputs& in,
                      const at::Tensor& o, const at::Tensor& lse,
                      const at::Tensor& dout) override {
    const int n = pg.world_size(), r = pg.rank();
    const auto ks = kv_layout(s, n).sizes();
    if (!k_full_.defined()) {
      k_full_ = gather_seq(pg, in.k, ks);
      v_full_ = gather_seq(pg, in.v, ks);
    }
    const auto acc = kernels::accumulation_dtype(in.q.scalar_type());
    at::Tensor dq, dk_full, dv_full;
    if (in.q.size(1) > 0) {
      const at::Tensor q_pos = q_layout(s, n).positions(r);
      auto g = kernels::attention_backward(in.q, k_full_, v_full_, dout, lse,
                                           kernels::attention_delta(dout, o),
                                           block_params(s, in, q_pos, at::arange(s.skv, at::kLong)));
      dq = g.dq;
      dk_full = g.dk;
      dv_full = g.dv;
    } else {  // no queries here: this rank contributes zero partials to the reduce-scatter
      dq = at::zeros(in.q.sizes(), in.q.options().dtype(acc));
      dk_full = at::zeros(k_full_.sizes(), k_full_.options().dtype(acc));
      dv_full = at::zeros_like(dk_full);
    }
    auto reduce_scatter = [&](const at::Tensor& full) {
      at::Tensor rows = full.transpose(0, 1).contiguous();  // [S, B, H, D]
      std::vector<int64_t> recv(n, ks[r]);
      at::Tensor got = pg.all_to_all(rows, ks, recv);        // [n·S_r, B, H, D]
      auto shape = rows.sizes().vec();
      shape[0] = ks[r];
      shape.insert(shape.begin(), n);
      return got.view(shape).sum(0).transpose(0, 1).contiguous();
    };
    LocalGrads out{dq, reduce_scatter(dk_full), reduce_scatter(dv_full)};
    k_full_ = v_full_ = at::Tensor();
    return out;
  }

  Volume analytic_bytes(const AttentionSpec& s, int n, int r, at::ScalarType dtype,
                        bool backward) const override {
    const auto ks = kv_layout(s, n).sizes();
    const int64_t e = element_bytes(dtype), a = element_bytes(kernels::accumulation_dtype(dtype));
    auto kv = [&](int j, int64_t bytes) { return 2 * s.batch * ks[j] * s.hkv * s.head_dim * bytes; };
    Volume v;
    if (n == 1) return v;
    for (int j = 0; j < n; ++j) {
      if (!backward) {  // ring all-gather: every block but next's passes through; all but mine arrive
        if (j != (r + 1) % n) v.sent += kv(j, e);
        if (j != r) v.received += kv(j, e);
      } else if (j != r) {  // reduce-scatter: my partial of j's block out, everyone's of mine in
        v.sent += kv(j, a);
        v.received += kv(r, a);
      }
    }
    return v;
  }

 private:
  at::Tensor k_full_, v_full_;
};

}  // namespace

std::unique_ptr<Strategy> make_all_gather() { return std::make_unique<AllGatherStrategy>(); }

}  // namespace lvx::attention
