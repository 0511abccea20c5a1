// ulysses: all-to-all from sequence sharding to head sharding, full-sequence attention on
// Hq/n query heads (and Hkv/n K/V heads), and all-to-all back (DeepSpeed-Ulysses; anchors A7).
// Needs Hq and Hkv divisible by n (refused otherwise, saying so). Final values (O, dQ, dK, dV)
// travel once, in the input dtype (the dtype contract of strategy.h); lse travels in fp32. The
// forward saves the head-sharded Q, K, V, O and lse (SavedForm::kHeadShards), so the backward
// moves only dO and the gradients.
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

  SavedForm saved_form() const override { return SavedForm::kHeadShards; }

  LocalOutput forward(dist::ProcessGroup& pg, const AttentionSpec& s, const LocalInputs& in,
                      SavedState* saved) const override {
    const int n = pg.world_size();
    check_supported(s, n);
    const auto qs = q_layout(s, n).sizes(), ks = kv_layout(s, n).sizes();
    at::Tensor qh = seq_to_heads(pg, in.q, qs);
    at::Tensor kh = seq_to_heads(pg, in.k, ks);
    at::Tensor vh = seq_to_heads(pg, in.v, ks);
    auto res = kernels::attention_forward(qh, kh, vh, whole_params(s, in.mask, n));
    const auto dt = in.q.scalar_type();
    // The final O travels once, in the input dtype (the contract's output dtype); lse in fp32.
    at::Tensor oh = res.o.to(dt);
    LocalOutput out{heads_to_seq(pg, oh, 1, 2, qs), heads_to_seq(pg, res.lse, 2, 1, qs)};
    if (saved) saved->tensors = {qh, kh, vh, oh, res.lse};
    return out;
  }

  LocalGrads backward(dist::ProcessGroup& pg, const AttentionSpec& s, const MaskInputs& mask,
                      const SavedState& saved, const at::Tensor& dout,
                      const at::Tensor& dlse) const override {
    const int n = pg.world_size();
    check_supported(s, n);
    LVX_CHECK(saved.tensors.size() == 5, "ulysses backward: needs the state its forward saved");
    const auto qs = q_layout(s, n).sizes(), ks = kv_layout(s, n).sizes();
    const at::Tensor &qh = saved.tensors[0], &kh = saved.tensors[1], &vh = saved.tensors[2];
    const at::Tensor &oh = saved.tensors[3], &lseh = saved.tensors[4];
    const auto dt = qh.scalar_type();
    at::Tensor doh = seq_to_heads(pg, dout.to(dt).contiguous(), qs);
    at::Tensor dlse_h;  // [B, Hq/n, Sq]: the lse gradient of this rank's heads, if any
    if (dlse.defined())
      dlse_h = seq_to_heads(pg, dlse.permute({0, 2, 1}).unsqueeze(-1).contiguous(), qs)
                   .squeeze(-1)
                   .permute({0, 2, 1});
    auto g = kernels::attention_backward(qh, kh, vh, doh, lseh, backward_delta(doh, oh, dlse_h),
                                         whole_params(s, mask, n));
    return {heads_to_seq(pg, g.dq.to(dt), 1, 2, qs), heads_to_seq(pg, g.dk.to(dt), 1, 2, ks),
            heads_to_seq(pg, g.dv.to(dt), 1, 2, ks)};
  }

  PassSchedule schedule(const AttentionSpec& s, int n, int r, at::ScalarType dtype,
                        bool backward) const override {
    const auto qs = q_layout(s, n).sizes(), ks = kv_layout(s, n).sizes();
    const int64_t e = element_bytes(dtype), a = element_bytes(kernels::accumulation_dtype(dtype));
    const int64_t hq = s.hq / n, hk = s.hkv / n, D = s.head_dim, B = s.batch;
    PassSchedule p;
    p.rounds = {Block{-1, -1}};
    p.head_divisor = n;
    // seq→head of a tensor with h heads per group: my tokens' group j go to j; j's tokens of my
    // group come back. head→seq: the reverse.
    auto a2a = [&](const char* what, const std::vector<int64_t>& sizes, int64_t per_token,
                   bool to_heads) {
      Message m{what, Message::kAllToAll, -1, 0, 0};
      for (int j = 0; j < n; ++j) {
        if (j == r) continue;
        m.sent += (to_heads ? sizes[r] : sizes[j]) * per_token;
        m.received += (to_heads ? sizes[j] : sizes[r]) * per_token;
      }
      p.messages.push_back(m);
    };
    if (!backward) {
      a2a("Q", qs, B * hq * D * e, true);
      a2a("K", ks, B * hk * D * e, true);
      a2a("V", ks, B * hk * D * e, true);
      a2a("O", qs, B * hq * D * e, false);
      a2a("lse", qs, B * hq * a, false);
    } else {
      a2a("dO", qs, B * hq * D * e, true);
      a2a("dQ", qs, B * hq * D * e, false);
      a2a("dK", ks, B * hk * D * e, false);
      a2a("dV", ks, B * hk * D * e, false);
    }
    return p;
  }

 private:
  // The whole sequence on this rank's head group.
  static kernels::AttentionParams whole_params(const AttentionSpec& s, const MaskInputs& mask,
                                               int64_t world) {
    // The whole sequence in the order the all-to-alls gather it: shard by shard, in rank order.
    const int n = static_cast<int>(world);
    return block_params(s, mask, Layout{s.q_layout, s.sq, n, 1}.gathered_positions(),
                        Layout{s.kv_layout, s.skv, n, s.kv_unit}.gathered_positions());
  }
};

}  // namespace

std::unique_ptr<Strategy> make_ulysses() { return std::make_unique<UlyssesStrategy>(); }

}  // namespace lvx::attention
