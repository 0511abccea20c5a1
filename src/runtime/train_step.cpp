#include "src/runtime/train_step.h"

#include <algorithm>
#include <vector>

#include "src/common/error.h"

namespace lvx::runtime {

namespace {

// This rank's summed cross-entropy over its rows (positions are host metadata; the labels may be
// on the host, the loss is on the logits' device) and the labelled tokens of every rank.
struct LocalLoss {
  at::Tensor sum;    // fp32 scalar, differentiable
  at::Tensor count;  // double [1], summed across ranks
};

LocalLoss local_loss(dist::ProcessGroup& pg, const at::Tensor& all_labels,
                     const models::ModelOutputs& out) {
  const at::Tensor labels =
      all_labels.index_select(1, out.positions.to(all_labels.device())).to(out.logits.device());
  at::Tensor count = labels.ne(-100).sum().to(at::kDouble).reshape({1});
  pg.all_reduce(count);
  LVX_CHECK(count.item<double>() > 0, "labels: every label is -100 (nothing to learn)");
  const at::Tensor logits = out.logits.to(at::kFloat).reshape({-1, out.logits.size(-1)});
  return {at::cross_entropy_loss(logits, labels.reshape({-1}), /*weight=*/{}, at::Reduction::Sum,
                                 /*ignore_index=*/-100),
          count};
}

}  // namespace

LocalBackward backward_local(dist::ProcessGroup& pg, models::Model& model,
                             const at::Tensor& all_labels, const models::ModelOutputs& out,
                             const std::vector<std::string>& names) {
  const auto [local_sum, count] = local_loss(pg, all_labels, out);
  LocalBackward r;
  // Every parameter's .grad is a view of one zeroed flat buffer, so autograd accumulates into it
  // in place (0 + g = g exactly) and the gradients exist once, already flat. No names: the
  // gradients are the hooks' business (ZeRO stage 3, src/runtime/layer_sharding.h).
  at::Tensor flat;
  if (!names.empty()) {
    int64_t total = 0;
    for (const auto& n : names) total += model.parameters().at(n).numel();
    flat = at::zeros({total}, model.parameters().at(names.front()).options());
    int64_t off = 0;
    for (const auto& n : names) {
      at::Tensor& t = model.parameters().at(n);
      LVX_CHECK(t.scalar_type() == flat.scalar_type(), "backward: parameter '", n, "' is ",
                t.scalar_type(), ", the others ", flat.scalar_type());
      t.mutable_grad() = flat.narrow(0, off, t.numel()).view(t.sizes());
      off += t.numel();
    }
  }
  (local_sum / count.item<double>()).backward();
  for (const auto& n : names) model.parameters().at(n).mutable_grad() = at::Tensor();
  if (flat.defined()) r.flat = flat.to(at::kFloat);  // no copy for fp32 parameters
  at::Tensor sum = local_sum.detach().to(at::kDouble).reshape({1});
  pg.all_reduce(sum);
  r.loss = (sum / count).to(at::kFloat).reshape({});
  return r;
}

double mean_loss(dist::ProcessGroup& pg, const at::Tensor& all_labels,
                 const models::ModelOutputs& out) {
  const auto [local_sum, count] = local_loss(pg, all_labels, out);
  at::Tensor sum = local_sum.detach().to(at::kDouble).reshape({1});
  pg.all_reduce(sum);
  return (sum / count).item<double>();
}

std::map<std::string, at::Tensor> backward_step(dist::ProcessGroup& pg, models::Model& model,
                                                const at::Tensor& all_labels,
                                                const models::ModelOutputs& out,
                                                const ParamFilter& trains) {
  const auto [local_sum, count] = local_loss(pg, all_labels, out);
  (local_sum / count.item<double>()).backward();
  std::vector<std::string> names;
  std::vector<at::Tensor> parts;
  for (auto& [name, t] : model.parameters()) {
    if (trains ? !trains(name) : !model.trainable(name)) continue;
    names.push_back(name);
    parts.push_back(t.grad().defined() ? t.grad().to(at::kFloat).reshape({-1})
                                       : at::zeros({t.numel()}, t.options().dtype(at::kFloat)));
  }
  std::map<std::string, at::Tensor> result;
  if (!parts.empty()) {
    at::Tensor flat = at::cat(parts);
    pg.all_reduce(flat);
    int64_t off = 0;
    for (size_t i = 0; i < names.size(); ++i) {
      const at::Tensor& t = model.parameters().at(names[i]);
      result["grad." + names[i]] = flat.narrow(0, off, t.numel()).view(t.sizes()).clone();
      off += t.numel();
    }
  }
  at::Tensor total = local_sum.detach().to(at::kDouble).reshape({1});
  pg.all_reduce(total);
  result["loss"] = (total / count).to(at::kFloat).reshape({});
  return result;
}

}  // namespace lvx::runtime
