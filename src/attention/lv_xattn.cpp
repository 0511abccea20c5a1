// lv_xattn: K/V stationary, the small query side travels (LV-XAttn, Chang & Venkataraman,
// ICML'25, §3.1, Fig. 3, eq. (1)), through ring_pipeline (src/attention/ring_pipeline.h). Round
// t on rank r attends the query block of rank r − t to the local K_r/V_r, giving a partial
// (O, lse) in fp32 that is merged into the block's running (O, lse) arriving from prev and sent
// on; after n rounds each block's (O, lse) has visited every rank and the last hop brings it
// home.
// Backward (BurstAttention Alg. 2): the bundle (Q, dO, lse, delta) travels the same way with the
// fp32 dQ accumulator following it; dK and dV never leave the rank.
#include <limits>

#include "src/attention/ring_pipeline.h"
#include "src/common/error.h"

namespace lvx::attention {
namespace {

class LvXAttnStrategy : public Strategy {
 public:
  StrategyKind kind() const override { return StrategyKind::kLvXAttn; }

  LocalOutput forward(dist::ProcessGroup& pg, const AttentionSpec& s, const LocalInputs& in,
                      SavedState* saved) const override {
    const int n = pg.world_size(), r = pg.rank();
    const Layout ql = q_layout(s, n), kl = kv_layout(s, n);
    const at::Tensor k_pos = kl.positions(r);
    const auto acc = kernels::accumulation_dtype(in.q.scalar_type());
    RingPass pass;
    pass.ahead_what = "lv_xattn forward Q";
    pass.behind_what = "lv_xattn forward O/lse";
    pass.compute = [&](int owner, const BlockTensors& blk) {
      const at::Tensor& q = blk.tensors[0];
      kernels::AttentionOutput part;
      if (q.size(1) > 0 && in.k.size(1) > 0) {
        part = kernels::attention_forward(q, in.k, in.v,
                                          block_params(s, in.mask, ql.positions(owner), k_pos));
      } else {
        part.o = at::zeros(q.sizes(), q.options().dtype(acc));
        part.lse = at::full({s.batch, s.hq, q.size(1)}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(acc));
      }
      return BlockTensors{{part.o, part.lse}, {1, 2}};
    };
    pass.combine = [](BlockTensors& mine, const BlockTensors& in) {
      kernels::merge_attention_states(mine.tensors[0], mine.tensors[1], in.tensors[0],
                                      in.tensors[1]);
    };
    BlockTensors ol = ring_pipeline(pg, ql, {{in.q}, {1}}, pass, s.node_size);
    LocalOutput out{ol.tensors[0].to(in.q.scalar_type()), ol.tensors[1]};
    if (saved) saved->tensors = {in.q, in.k, in.v, out.o, out.lse};
    return out;
  }

  LocalGrads backward(dist::ProcessGroup& pg, const AttentionSpec& s, const MaskInputs& mask,
                      const SavedState& saved, const at::Tensor& dout,
                      const at::Tensor& dlse) const override {
    const int n = pg.world_size(), r = pg.rank();
    const Layout ql = q_layout(s, n), kl = kv_layout(s, n);
    const at::Tensor &q0 = saved.tensors.at(0), &k = saved.tensors.at(1), &v = saved.tensors.at(2);
    const at::Tensor &o = saved.tensors.at(3), &lse = saved.tensors.at(4);
    const at::Tensor k_pos = kl.positions(r);
    const auto acc = kernels::accumulation_dtype(q0.scalar_type());
    const at::Tensor delta = backward_delta(dout, o, dlse);  // at home, from the final O
    at::Tensor dk = at::zeros(k.sizes(), k.options().dtype(acc));
    at::Tensor dv = at::zeros(v.sizes(), v.options().dtype(acc));
    RingPass pass;
    pass.ahead_what = "lv_xattn backward Q/dO/lse/delta";
    pass.behind_what = "lv_xattn backward dQ";
    pass.compute = [&](int owner, const BlockTensors& blk) {
      const at::Tensor &q = blk.tensors[0], &dO = blk.tensors[1];
      const at::Tensor &l = blk.tensors[2], &d = blk.tensors[3];
      if (q.size(1) == 0 || k.size(1) == 0)
        return BlockTensors{{at::zeros(q.sizes(), q.options().dtype(acc))}, {1}};
      auto g = kernels::attention_backward(q, k, v, dO, l, d,
                                           block_params(s, mask, ql.positions(owner), k_pos));
      dk.add_(g.dk);
      dv.add_(g.dv);
      return BlockTensors{{g.dq}, {1}};
    };
    pass.combine = [](BlockTensors& mine, const BlockTensors& in) {
      mine.tensors[0].add_(in.tensors[0]);
    };
    const at::Tensor dO = dout.to(q0.scalar_type()).contiguous();
    BlockTensors dq = ring_pipeline(pg, ql, {{q0, dO, lse.contiguous(), delta}, {1, 1, 2, 2}}, pass,
                                    s.node_size);
    const auto dt = q0.scalar_type();
    return {dq.tensors[0].to(dt), dk.to(dt), dv.to(dt)};
  }

  PassSchedule schedule(const AttentionSpec& s, int n, int r, at::ScalarType dtype,
                        bool backward) const override {
    const int64_t e = element_bytes(dtype);
    const int64_t a = element_bytes(kernels::accumulation_dtype(dtype));
    const int64_t q_token = s.batch * s.hq * s.head_dim, stat_token = s.batch * s.hq;
    const Layout ql = q_layout(s, n);
    if (!backward)  // Q ahead; partial O and lse (fp32) behind
      return ring_schedule(ql, r, /*q_travels=*/true, "Q", q_token * e, "O/lse",
                           (q_token + stat_token) * a, s.node_size);
    // Q and dO (input dtype), lse and delta (accumulation dtype) ahead; dQ (fp32) behind
    return ring_schedule(ql, r, true, "Q/dO/lse/delta", 2 * q_token * e + 2 * stat_token * a, "dQ",
                         q_token * a, s.node_size);
  }
};

}  // namespace

std::unique_ptr<Strategy> make_lv_xattn() { return std::make_unique<LvXAttnStrategy>(); }

}  // namespace lvx::attention
