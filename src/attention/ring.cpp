// ring and striped: Q stationary, K/V travel around the ring (BurstAttention Alg. 1; Ring
// Attention), through ring_pipeline (src/attention/ring_pipeline.h). Backward: K and V travel
// again, each block followed by its fp32 dK/dV accumulators, which arrive home after n hops; dQ
// accumulates locally.
// striped is the same algorithm over the striped layout (Striped Attention, Brandon et al. §3):
// with the causal mask expressed through global positions, every round's block is about half
// visible on every rank, and the kernel skips the invisible tiles.
#include <limits>

#include "src/attention/ring_pipeline.h"
#include "src/common/error.h"

namespace lvx::attention {
namespace {

class RingStrategy : public Strategy {
 public:
  StrategyKind kind() const override { return StrategyKind::kRing; }

  LocalOutput forward(dist::ProcessGroup& pg, const AttentionSpec& s, const LocalInputs& in,
                      SavedState* saved) const override {
    const int n = pg.world_size(), r = pg.rank();
    const Layout ql = q_layout(s, n), kl = kv_layout(s, n);
    const at::Tensor q_pos = ql.positions(r);
    const auto acc = kernels::accumulation_dtype(in.q.scalar_type());
    at::Tensor o = at::zeros(in.q.sizes(), in.q.options().dtype(acc));
    at::Tensor lse = at::full({s.batch, s.hq, in.q.size(1)},
                              -std::numeric_limits<double>::infinity(), in.q.options().dtype(acc));
    RingPass pass;
    pass.ahead_what = "ring forward K/V";
    pass.compute = [&](int owner, const BlockTensors& kv) {
      const at::Tensor &k = kv.tensors[0], &v = kv.tensors[1];
      if (k.size(1) > 0 && in.q.size(1) > 0) {
        auto part =
            kernels::attention_forward(in.q, k, v, block_params(s, in.mask, q_pos, kl.positions(owner)));
        kernels::merge_attention_states(o, lse, part.o, part.lse);
      }
      return BlockTensors{};
    };
    ring_pipeline(pg, kl, {{in.k, in.v}, {1, 1}}, pass, s.node_size);
    LocalOutput out{o.to(in.q.scalar_type()), lse};
    if (saved) saved->tensors = {in.q, in.k, in.v, out.o, out.lse};
    return out;
  }

  LocalGrads backward(dist::ProcessGroup& pg, const AttentionSpec& s, const MaskInputs& mask,
                      const SavedState& saved, const at::Tensor& dout,
                      const at::Tensor& dlse) const override {
    const int n = pg.world_size(), r = pg.rank();
    const Layout ql = q_layout(s, n), kl = kv_layout(s, n);
    const at::Tensor &q = saved.tensors.at(0), &k0 = saved.tensors.at(1), &v0 = saved.tensors.at(2);
    const at::Tensor &o = saved.tensors.at(3), &lse = saved.tensors.at(4);
    const at::Tensor q_pos = ql.positions(r);
    const auto acc = kernels::accumulation_dtype(q.scalar_type());
    const at::Tensor delta = backward_delta(dout, o, dlse);
    at::Tensor dq = at::zeros(q.sizes(), q.options().dtype(acc));
    RingPass pass;
    pass.ahead_what = "ring backward K/V";
    pass.behind_what = "ring backward dK/dV";
    pass.compute = [&](int owner, const BlockTensors& kv) {
      const at::Tensor &k = kv.tensors[0], &v = kv.tensors[1];
      if (k.size(1) == 0 || q.size(1) == 0) {
        auto z = at::zeros(k.sizes(), k.options().dtype(acc));
        return BlockTensors{{z, z.clone()}, {1, 1}};
      }
      auto g = kernels::attention_backward(q, k, v, dout, lse, delta,
                                           block_params(s, mask, q_pos, kl.positions(owner)));
      dq.add_(g.dq);
      return BlockTensors{{g.dk, g.dv}, {1, 1}};
    };
    pass.combine = [](BlockTensors& mine, const BlockTensors& in) {
      mine.tensors[0].add_(in.tensors[0]);
      mine.tensors[1].add_(in.tensors[1]);
    };
    BlockTensors dkv = ring_pipeline(pg, kl, {{k0, v0}, {1, 1}}, pass, s.node_size);
    const auto dt = q.scalar_type();
    return {dq.to(dt), dkv.tensors[0].to(dt), dkv.tensors[1].to(dt)};
  }

  PassSchedule schedule(const AttentionSpec& s, int n, int r, at::ScalarType dtype,
                        bool backward) const override {
    const int64_t e = element_bytes(dtype);
    const int64_t a = element_bytes(kernels::accumulation_dtype(dtype));
    const int64_t kv_token = 2 * s.batch * s.hkv * s.head_dim;  // K and V elements per token
    return ring_schedule(kv_layout(s, n), r, /*q_travels=*/false,
                         backward ? "K/V (backward)" : "K/V", kv_token * e, "dK/dV",
                         backward ? kv_token * a : 0, s.node_size);
  }
};

class StripedStrategy : public RingStrategy {
 public:
  StrategyKind kind() const override { return StrategyKind::kStriped; }
  Layout q_layout(const AttentionSpec& s, int world) const override {
    return Layout{LayoutKind::kStriped, s.sq, world};
  }
  // Keys in whole blocks (a model's visual keys, kv_unit tokens per image) stay in whole blocks,
  // striped by block: striping splits the tokens, never an image.
  Layout kv_layout(const AttentionSpec& s, int world) const override {
    return Layout{LayoutKind::kStriped, s.skv, world, s.kv_unit};
  }
};

}  // namespace

std::unique_ptr<Strategy> make_ring() { return std::make_unique<RingStrategy>(); }
std::unique_ptr<Strategy> make_striped() { return std::make_unique<StripedStrategy>(); }

}  // namespace lvx::attention
