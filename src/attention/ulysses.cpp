// ulysses: all-to-all from sequence sharding to head sharding, full-sequence attention on
// Hq/n query heads (and Hkv/n K/V heads), and all-to-all back (DeepSpeed-Ulysses; anchors A7).
// Needs Hq and Hkv divisible by n (refused otherwise, saying so). Final values (O, dQ, dK, dV)
// travel once, in the input dtype; lse travels in fp32. The head-sharded Q, K, V, O and lse are
// kept from forward for backward, so backward moves only dO and the gradients.
#include "src/attention/strategy.h"
#include "src/common/error.h"

namespace lvx::attention {
namespace {

class UlyssesStrategy : public Strategy {
 public:
  StrategyKind kind() const override { return StrategyKind::kUlysses; }

  void check_supported(const AttentionSpec& s, int n) const override {
    LVX_CHECK(s.hq % n == 0 && s.hkv % n == 0, "ulysses shards heads across ranks: ", s.hq,
              " query heads and ", s.hkv, " K/V heads must both divide by the ", n,
              " ranks (use lv_xattn, ring or all_gather, or a rank count dividing ", s.hkv, ")");
  }

  // [B, S_r, H, D] sequence shard → [B, S, H/n, D] head shard (rank r gets head group r).
  static at::Tensor seq_to_heads(dist::ProcessGroup& pg, const at::Tensor& x,
                                 const std::vector<int64_t>& seq_sizes) {
    const int n = pg.world_size();
    const int64_t B = x.size(0), Sr = x.size(1), H = x.size(2), D = x.size(3), Hn = H / n;
    at::Tensor parts = x.reshape({B, Sr, n, Hn, D}).permute({2, 0, 1, 3, 4}).contiguous();
    std::vector<int64_t> send(n, B * Sr * Hn * D), recv(n);
    for (int j = 0; j < n; ++j) recv[j] = B * seq_sizes[j] * Hn * D;
    at::Tensor got = pg.all_to_all(parts.view({-1}), send, recv);
    std::vector<at::Tensor> chunks;
    int64_t off = 0;
    for (int j = 0; j < n; ++j) {
      chunks.push_back(got.narrow(0, off, recv[j]).view({B, seq_sizes[j], Hn, D}));
      off += recv[j];
    }
    return at::cat(chunks, 1);
  }

  // [B, S, H/n, D] head shard → [B, S_r, H, D] sequence shard. `head_dim_index` is the head
  // dimension (2 for [B, S, H, D]; 1 for lse [B, H, S] with seq_dim 2).
  static at::Tensor heads_to_seq(dist::ProcessGroup& pg, const at::Tensor& x, int64_t seq_dim,
                                 int64_t head_dim_index, const std::vector<int64_t>& seq_sizes) {
    const int n = pg.world_size(), r = pg.rank();
    std::vector<at::Tensor> pieces;
    int64_t off = 0;
    for (int j = 0; j < n; ++j) {
      pieces.push_back(x.narrow(seq_dim, off, seq_sizes[j]).contiguous().view({-1}));
      off += seq_sizes[j];
    }
    std::vector<int64_t> send(n), recv(n);
    for (int j = 0; j < n; ++j) {
      send[j] = pieces[j].numel();
      recv[j] = pieces[r].numel();  // every rank sends me its head group of my tokens
    }
    at::Tensor got = pg.all_to_all(at::cat(pieces), send, recv);
    auto shape = x.sizes().vec();
    shape[seq_dim] = seq_sizes[r];
    std::vector<at::Tensor> groups;
    for (int j = 0; j < n; ++j) groups.push_back(got.narrow(0, j * recv[j], recv[j]).view(shape));
    return at::cat(groups, head_dim_index);
  }

  LocalOutput forward(dist::ProcessGroup& pg, const AttentionSpec& s,
                      const LocalInputs& in) override {
    const int n = pg.world_size();
    check_supported(s, n);
    const auto qs = q_layout(s, n).sizes(), ks = kv_layout(s, n).sizes();
    qh_ = seq_to_heads(pg, in.q, qs);
    kh_ = seq_to_heads(pg, in.k, ks);
    vh_ = seq_to_heads(pg, in.v, ks);
    auto res = kernels::attention_forward(
        qh_, kh_, vh_, block_params(s, in, at::arange(s.sq, at::kLong), at::arange(s.skv, at::kLong)));
    oh_ = res.o;
    lseh_ = res.lse;
    at::Tensor o = heads_to_seq(pg, res.o.to(in.q.scalar_type()), 1, 2, qs).to(res.o.scalar_type());
    at::Tensor lse = heads_to_seq(pg, res.lse, 2, 1, qs);
    return {o, lse};
  }

  LocalGrads backward(dist::ProcessGroup& pg, const AttentionSpec& s, const LocalInputs& in,
                      const at::Tensor& o, const at::Tensor& lse,
                      const at::Tensor& dout) override {
    const int n = pg.world_size();
    check_supported(s, n);
    const auto qs = q_layout(s, n).sizes(), ks = kv_layout(s, n).sizes();
    if (!qh_.defined()) forward(pg, s, in);  // backward without a saved forward: redo it
    at::Tensor doh = seq_to_heads(pg, dout.to(in.q.scalar_type()).contiguous(), qs);
    at::Tensor delta = kernels::attention_delta(doh, oh_);
    auto g = kernels::attention_backward(
        qh_, kh_, vh_, doh, lseh_, delta,
        block_params(s, in, at::arange(s.sq, at::kLong), at::arange(s.skv, at::kLong)));
    const auto dt = in.q.scalar_type();
    const auto acc = g.dq.scalar_type();
    LocalGrads out{heads_to_seq(pg, g.dq.to(dt), 1, 2, qs).to(acc),
                   heads_to_seq(pg, g.dk.to(dt), 1, 2, ks).to(acc),
                   heads_to_seq(pg, g.dv.to(dt), 1, 2, ks).to(acc)};
    qh_ = kh_ = vh_ = oh_ = lseh_ = at::Tensor();
    return out;
  }

  Volume analytic_bytes(const AttentionSpec& s, int n, int r, at::ScalarType dtype,
                        bool backward) const override {
    const auto qs = q_layout(s, n).sizes(), ks = kv_layout(s, n).sizes();
    const int64_t e = element_bytes(dtype), a = element_bytes(kernels::accumulation_dtype(dtype));
    const int64_t hq = s.hq / n, hk = s.hkv / n, D = s.head_dim, B = s.batch;
    Volume v;
    for (int j = 0; j < n; ++j) {
      if (j == r) continue;
      // seq→head: my tokens' head group j goes to j; I get j's tokens of my head group.
      // head→seq: my head group of j's tokens goes to j; I get j's head group of my tokens.
      const int64_t q_out = B * qs[r] * hq * D, q_in = B * qs[j] * hq * D;
      const int64_t k_out = B * ks[r] * hk * D, k_in = B * ks[j] * hk * D;
      const int64_t o_out = B * qs[j] * hq * D, o_in = B * qs[r] * hq * D;
      const int64_t dk_out = B * ks[j] * hk * D, dk_in = B * ks[r] * hk * D;
      if (!backward) {
        v.sent += (q_out + 2 * k_out + o_out) * e + B * hq * qs[j] * a;
        v.received += (q_in + 2 * k_in + o_in) * e + B * hq * qs[r] * a;
      } else {  // dO seq→head, then dQ, dK, dV head→seq
        v.sent += (q_out + o_out + 2 * dk_out) * e;
        v.received += (q_in + o_in + 2 * dk_in) * e;
      }
    }
    return v;
  }

 private:
  at::Tensor qh_, kh_, vh_, oh_, lseh_;  // saved for backward (head-sharded)
};

}  // namespace

std::unique_ptr<Strategy> make_ulysses() { return std::make_unique<UlyssesStrategy>(); }

}  // namespace lvx::attention
