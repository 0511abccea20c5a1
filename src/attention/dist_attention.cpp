#include "src/attention/dist_attention.h"

#include <torch/csrc/autograd/custom_function.h>

#include "src/common/error.h"

namespace lvx::attention {
namespace {

// Non-tensor state of one call, carried from forward to backward in the autograd context.
struct CallState : torch::CustomClassHolder {
  std::shared_ptr<dist::ProcessGroup> pg;
  std::unique_ptr<Strategy> strategy;
  AttentionSpec spec;
  at::Tensor q_media, kv_media;
};

struct DistAttentionFunction : public torch::autograd::Function<DistAttentionFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, c10::IValue state_value) {
    auto state = c10::static_intrusive_pointer_cast<CallState>(state_value.toCapsule());
    LocalInputs in{q.detach(), k.detach(), v.detach(), state->q_media, state->kv_media, {}};
    LocalOutput out = state->strategy->forward(*state->pg, state->spec, in);
    ctx->save_for_backward({q, k, v, out.o, out.lse});
    ctx->saved_data["state"] = state_value;
    ctx->mark_non_differentiable({out.lse});
    return {out.o.to(q.scalar_type()), out.lse.to(at::kFloat)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<CallState>(ctx->saved_data["state"].toCapsule());
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &o = saved[3], &lse = saved[4];
    at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(q);
    LocalInputs in{q.detach(), k.detach(), v.detach(), state->q_media, state->kv_media, {}};
    LocalGrads g = state->strategy->backward(*state->pg, state->spec, in, o, lse, dout);
    return {g.dq.to(q.scalar_type()), g.dk.to(k.scalar_type()), g.dv.to(v.scalar_type()),
            at::Tensor()};
  }
};

}  // namespace

DistAttentionResult dist_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   std::shared_ptr<dist::ProcessGroup> pg, StrategyKind kind,
                                   const AttentionSpec& spec, const at::Tensor& q_media,
                                   const at::Tensor& kv_media) {
  LVX_CHECK(pg != nullptr, "dist_attention: no process group");
  auto state = c10::make_intrusive<CallState>();
  state->pg = std::move(pg);
  state->strategy = make_strategy(kind);
  state->strategy->check_supported(spec, state->pg->world_size());
  state->spec = spec;
  state->q_media = q_media;
  state->kv_media = kv_media;
  auto outs = DistAttentionFunction::apply(q, k, v, c10::IValue::make_capsule(state));
  return {outs[0], outs[1]};
}

}  // namespace lvx::attention
