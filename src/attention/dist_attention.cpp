#include "src/attention/dist_attention.h"

#include <torch/csrc/autograd/custom_function.h>

#include "src/common/error.h"

namespace lvx::attention {
namespace {

// Non-tensor state of one call, carried from forward to backward in the autograd context.
struct CallState : torch::CustomClassHolder {
  std::shared_ptr<dist::ProcessGroup> pg;
  std::unique_ptr<Strategy> forward, backward;
  AttentionSpec spec;
  MaskInputs mask;
};

struct DistAttentionFunction : public torch::autograd::Function<DistAttentionFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, c10::IValue state_value) {
    auto state = c10::static_intrusive_pointer_cast<CallState>(state_value.toCapsule());
    SavedState saved;
    LocalOutput out = state->forward->forward(*state->pg, state->spec,
                                              {q.detach(), k.detach(), v.detach(), state->mask},
                                              &saved);
    ctx->save_for_backward(saved.tensors);  // the one copy of what the backward needs
    ctx->saved_data["state"] = state_value;
    return {out.o, out.lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto state = c10::static_intrusive_pointer_cast<CallState>(ctx->saved_data["state"].toCapsule());
    SavedState saved{ctx->get_saved_variables()};
    at::Tensor dout = grads[0];
    if (!dout.defined()) dout = at::zeros_like(saved.tensors.at(3));
    // A gradient on lse (callers merging partial results by lse) folds into delta.
    LocalGrads g =
        state->backward->backward(*state->pg, state->spec, state->mask, saved, dout, grads[1]);
    return {g.dq, g.dk, g.dv, at::Tensor()};
  }
};

}  // namespace

PreparedCall prepare_call(const std::string& where, const dist::ProcessGroup& pg,
                          StrategyChoice choice, const AttentionSpec& spec, const at::Tensor& q,
                          const at::Tensor& k) {
  LVX_CHECK(can_pair(choice.forward, choice.backward), where, ": the backward of ",
            strategy_name(choice.backward), " cannot start from the state the forward of ",
            strategy_name(choice.forward), " saves");
  PreparedCall c{make_strategy(choice.forward), make_strategy(choice.backward), {}};
  c.forward->check_supported(spec, pg.world_size());
  c.backward->check_supported(spec, pg.world_size());
  check_local_shards(where, spec, *c.forward, pg.world_size(), pg.rank(), q, k);
  c.spec = with_topology(spec, pg);
  return c;
}

DistAttentionResult dist_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   std::shared_ptr<dist::ProcessGroup> pg, StrategyChoice choice,
                                   const AttentionSpec& spec, const MaskInputs& mask) {
  LVX_CHECK(pg != nullptr, "dist_attention: no process group");
  PreparedCall call = prepare_call("dist_attention", *pg, choice, spec, q, k);
  auto state = c10::make_intrusive<CallState>();
  state->pg = std::move(pg);
  state->forward = std::move(call.forward);
  state->backward = std::move(call.backward);
  state->spec = call.spec;
  state->mask = mask;
  auto outs = DistAttentionFunction::apply(q, k, v, c10::IValue::make_capsule(state));
  return {outs[0], outs[1]};
}

}  // namespace lvx::attention
