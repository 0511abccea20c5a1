// all_gather: gather the full K and V on every rank (ring all-gather), attend the local queries
// to them, and in backward reduce-scatter the fp32 dK/dV partials back to their owners
// (pairwise all-to-all, then a local sum) — Llama-3-style context parallelism (anchors A9).
// The forward saves the gathered K/V for the backward (SavedForm::kGatheredKV: memory traded
// for communication).
#include <algorithm>

#include "src/attention/strategy.h"
#include "src/common/error.h"

namespace lvx::attention {
namespace {

class AllGatherStrategy : public Strategy {
 public:
  StrategyKind kind() const override { return StrategyKind::kAllGather; }

  // [B, S_r, H, D] → [B, S, H, D] gathered along the sequence: one ring all-gather of shards
  // padded to the largest (shards of whole frames differ by up to a frame), the padding dropped.
  static at::Tensor gather_seq(dist::ProcessGroup& pg, const at::Tensor& x,
                               const std::vector<int64_t>& sizes) {
    const int64_t most = *std::max_element(sizes.begin(), sizes.end());
    at::Tensor rows = x.transpose(0, 1).contiguous();  // [S_r, B, H, D]
    if (rows.size(0) < most) {
      auto shape = rows.sizes().vec();
      shape[0] = most - rows.size(0);
      rows = at::cat({rows, at::zeros(shape, rows.options())});
    }
    at::Tensor all = pg.all_gather(rows);  // [n·most, B, H, D]
    std::vector<at::Tensor> pieces;
    for (size_t j = 0; j < sizes.size(); ++j)
      pieces.push_back(all.narrow(0, static_cast<int64_t>(j) * most, sizes[j]));
    return at::cat(pieces).transpose(0, 1).contiguous();
  }

  SavedForm saved_form() const override { return SavedForm::kGatheredKV; }

  LocalOutput forward(dist::ProcessGroup& pg, const AttentionSpec& s, const LocalInputs& in,
                      SavedState* saved) const override {
    const int n = pg.world_size();
    const auto ks = kv_layout(s, n).sizes();
    at::Tensor k_full = gather_seq(pg, in.k, ks), v_full = gather_seq(pg, in.v, ks);
    const auto acc = kernels::accumulation_dtype(in.q.scalar_type());
    LocalOutput out;
    if (in.q.size(1) == 0) {
      out = {at::zeros(in.q.sizes(), in.q.options()),
             at::empty({s.batch, s.hq, 0}, in.q.options().dtype(acc))};
    } else {
      auto res = kernels::attention_forward(in.q, k_full, v_full, params(s, in.mask, pg.rank(), n));
      out = {res.o.to(in.q.scalar_type()), res.lse};
    }
    if (saved) saved->tensors = {in.q, k_full, v_full, out.o, out.lse};
    return out;
  }

  LocalGrads backward(dist::ProcessGroup& pg, const AttentionSpec& s, const MaskInputs& mask,
                      const SavedState& saved, const at::Tensor& dout,
                      const at::Tensor& dlse) const override {
    const int n = pg.world_size(), r = pg.rank();
    LVX_CHECK(saved.tensors.size() == 5, "all_gather backward: needs the state its forward saved");
    const at::Tensor &q = saved.tensors[0], &k_full = saved.tensors[1], &v_full = saved.tensors[2];
    const at::Tensor &o = saved.tensors[3], &lse = saved.tensors[4];
    const auto ks = kv_layout(s, n).sizes();
    const auto acc = kernels::accumulation_dtype(q.scalar_type());
    at::Tensor dq, dk_full, dv_full;
    if (q.size(1) > 0) {
      auto g = kernels::attention_backward(q, k_full, v_full, dout, lse,
                                           backward_delta(dout, o, dlse), params(s, mask, r, n));
      dq = g.dq;
      dk_full = g.dk;
      dv_full = g.dv;
    } else {  // no queries here: this rank contributes zero partials to the reduce-scatter
      dq = at::zeros(q.sizes(), q.options().dtype(acc));
      dk_full = at::zeros(k_full.sizes(), k_full.options().dtype(acc));
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
    const auto dt = q.scalar_type();
    return {dq.to(dt), reduce_scatter(dk_full).to(dt), reduce_scatter(dv_full).to(dt)};
  }

  PassSchedule schedule(const AttentionSpec& s, int n, int r, at::ScalarType dtype,
                        bool backward) const override {
    const auto ks = kv_layout(s, n).sizes();
    const int64_t e = element_bytes(dtype), a = element_bytes(kernels::accumulation_dtype(dtype));
    auto block = [&](int j, int64_t bytes) { return s.batch * ks[j] * s.hkv * s.head_dim * bytes; };
    const int64_t most = *std::max_element(ks.begin(), ks.end());
    auto most_block = [&](int64_t bytes) { return s.batch * most * s.hkv * s.head_dim * bytes; };
    PassSchedule p;
    p.rounds = {Block{r, -1}};
    if (n == 1) return p;
    for (const char* what : backward ? std::vector<const char*>{"dK", "dV"}
                                     : std::vector<const char*>{"K", "V"}) {
      Message m{what, backward ? Message::kAllToAll : Message::kAllGatherRing, -1, 0, 0};
      for (int j = 0; j < n; ++j) {
        if (!backward) {  // ring all-gather of blocks padded to the largest: n − 1 of them pass
                          // through me each way
          if (j != (r + 1) % n) m.sent += most_block(e);
          if (j != r) m.received += most_block(e);
        } else if (j != r) {  // reduce-scatter: my partial of j's block out, everyone's of mine in
          m.sent += block(j, a);
          m.received += block(r, a);
        }
      }
      p.messages.push_back(m);
    }
    return p;
  }

 private:
  // This rank's queries against the whole key sequence.
  kernels::AttentionParams params(const AttentionSpec& s, const MaskInputs& mask, int r,
                                  int n) const {
    // Keys in the order the all-gather concatenates them: shard by shard, in rank order.
    return block_params(s, mask, q_layout(s, n).positions(r), kv_layout(s, n).gathered_positions());
  }
};

}  // namespace

std::unique_ptr<Strategy> make_all_gather() { return std::make_unique<AllGatherStrategy>(); }

}  // namespace lvx::attention
