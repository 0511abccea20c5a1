#include "models/recompute.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "src/common/error.h"

namespace lvx::models {
namespace {

struct RecomputeState : torch::CustomClassHolder {
  std::shared_ptr<dist::ProcessGroup> pg;
  std::unique_ptr<attention::Strategy> forward, backward;
  attention::AttentionSpec spec;
  attention::MaskInputs mask;
  KVFunction kv;
  size_t n_params = 0;
};

struct CrossRecompute : public torch::autograd::Function<CrossRecompute> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& q, const at::Tensor& y,
                                                at::TensorList params, c10::IValue state_value) {
    auto st = c10::static_intrusive_pointer_cast<RecomputeState>(state_value.toCapsule());
    std::vector<at::Tensor> p(params.begin(), params.end());
    auto [k, v] = st->kv(y, p);  // grad mode is off here: K/V are not kept
    attention::SavedState saved;
    attention::LocalOutput out =
        st->forward->forward(*st->pg, st->spec, {q.detach(), k, v, st->mask}, &saved);
    // Keep q, y, the parameters (references: they exist anyway), o and lse — never K/V.
    std::vector<at::Tensor> keep{q, y};
    keep.insert(keep.end(), p.begin(), p.end());
    keep.push_back(out.o);
    keep.push_back(out.lse);
    ctx->save_for_backward(keep);
    ctx->saved_data["state"] = state_value;
    return {out.o, out.lse};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto st =
        c10::static_intrusive_pointer_cast<RecomputeState>(ctx->saved_data["state"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& q = saved[0];
    const at::Tensor &o = saved[2 + st->n_params], &lse = saved[3 + st->n_params];
    at::AutoGradMode grad_on(true);
    // Recompute K/V from leaves that stand for y and the parameters.
    std::vector<at::Tensor> leaves{saved[1].detach().requires_grad_(true)};
    for (size_t i = 0; i < st->n_params; ++i)
      leaves.push_back(saved[2 + i].detach().requires_grad_(true));
    auto [k, v] = st->kv(leaves[0], std::vector<at::Tensor>(leaves.begin() + 1, leaves.end()));
    at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(o);
    attention::SavedState state{{q.detach(), k.detach(), v.detach(), o, lse}};
    attention::LocalGrads g =
        st->backward->backward(*st->pg, st->spec, st->mask, state, dout, grads[1]);
    auto d = torch::autograd::grad({k, v}, leaves, {g.dk, g.dv}, /*retain_graph=*/false,
                                   /*create_graph=*/false, /*allow_unused=*/true);
    torch::autograd::variable_list out{g.dq};
    for (size_t i = 0; i < d.size(); ++i) out.push_back(d[i]);
    out.push_back(at::Tensor());  // the state
    return out;
  }
};

struct SegmentState : torch::CustomClassHolder {
  SegmentFunction fn;
  size_t n_inputs = 0, n_params = 0;
};

struct Segment : public torch::autograd::Function<Segment> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs, at::TensorList params,
                                                c10::IValue state_value) {
    auto st = c10::static_intrusive_pointer_cast<SegmentState>(state_value.toCapsule());
    std::vector<at::Tensor> in(inputs.begin(), inputs.end()), p(params.begin(), params.end());
    std::vector<at::Tensor> keep = in;  // inputs and parameters only, never intermediates
    keep.insert(keep.end(), p.begin(), p.end());
    ctx->save_for_backward(keep);
    ctx->saved_data["state"] = state_value;
    return st->fn(in, p);  // grad mode is off: nothing inside is kept
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto st =
        c10::static_intrusive_pointer_cast<SegmentState>(ctx->saved_data["state"].toCapsule());
    const auto saved = ctx->get_saved_variables();
    at::AutoGradMode grad_on(true);
    std::vector<at::Tensor> leaves;
    for (const auto& t : saved) leaves.push_back(t.detach().requires_grad_(t.is_floating_point()));
    const std::vector<at::Tensor> in(leaves.begin(), leaves.begin() + st->n_inputs);
    const std::vector<at::Tensor> p(leaves.begin() + st->n_inputs, leaves.end());
    const std::vector<at::Tensor> outs = st->fn(in, p);
    std::vector<at::Tensor> used_outs, used_grads;
    for (size_t i = 0; i < outs.size(); ++i)
      if (grads[i].defined() && outs[i].requires_grad()) {
        used_outs.push_back(outs[i]);
        used_grads.push_back(grads[i]);
      }
    std::vector<at::Tensor> wrt;
    for (const auto& l : leaves)
      if (l.requires_grad()) wrt.push_back(l);
    torch::autograd::variable_list d(leaves.size());
    if (!used_outs.empty()) {
      auto g = torch::autograd::grad(used_outs, wrt, used_grads, false, false, true);
      size_t k = 0;
      for (size_t i = 0; i < leaves.size(); ++i)
        if (leaves[i].requires_grad()) d[i] = g[k++];
    }
    d.push_back(at::Tensor());  // the state
    return d;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint_segment(SegmentFunction fn,
                                           const std::vector<at::Tensor>& inputs,
                                           const std::vector<at::Tensor>& params) {
  auto st = c10::make_intrusive<SegmentState>();
  st->fn = std::move(fn);
  st->n_inputs = inputs.size();
  st->n_params = params.size();
  return Segment::apply(at::TensorList(inputs), at::TensorList(params),
                        c10::IValue::make_capsule(st));
}

attention::DistAttentionResult cross_attention_recompute(
    const at::Tensor& q, const at::Tensor& y, const std::vector<at::Tensor>& params, KVFunction kv,
    std::shared_ptr<dist::ProcessGroup> pg, attention::StrategyChoice choice,
    const attention::AttentionSpec& spec, const attention::MaskInputs& mask) {
  auto st = c10::make_intrusive<RecomputeState>();
  st->forward = attention::make_strategy(choice.forward);
  st->backward = attention::make_strategy(choice.backward);
  LVX_CHECK(st->forward->saved_form() == attention::SavedForm::kShards &&
                attention::can_pair(choice.forward, choice.backward),
            "K/V recomputation (LV-XAttn §3.2) needs a strategy that saves only the local shards ",
            "(lv_xattn, ring, striped), got ", choice.name());
  st->forward->check_supported(spec, pg->world_size());
  st->pg = std::move(pg);
  st->spec = attention::with_topology(spec, *st->pg);
  st->mask = mask;
  st->kv = std::move(kv);
  st->n_params = params.size();
  auto outs = CrossRecompute::apply(q, y, at::TensorList(params), c10::IValue::make_capsule(st));
  return {outs[0], outs[1]};
}

}  // namespace lvx::models
