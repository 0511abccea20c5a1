#include "src/runtime/optimizer.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <vector>

#include "src/common/error.h"

namespace lvx::runtime {

double learning_rate(const TrainConfig::Optimizer& o, const TrainConfig::Schedule& s,
                     int64_t step) {
  if (s.warmup_steps > 0 && step < s.warmup_steps)
    return o.lr * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  const double t = static_cast<double>(step - s.warmup_steps) /
                   static_cast<double>(std::max<int64_t>(1, s.steps - s.warmup_steps));
  return s.min_lr + (o.lr - s.min_lr) * 0.5 * (1.0 + std::cos(M_PI * std::min(1.0, t)));
}

double clip_grad_norm(std::map<std::string, at::Tensor>& grads, double max_norm) {
  if (grads.empty()) return 0;
  // Same operations as clip_grad_norm_'s per-tensor path: each norm, the norm of the norms.
  std::vector<at::Tensor> norms;
  for (auto& [name, g] : grads) norms.push_back(at::linalg_vector_norm(g, 2));
  const at::Tensor total = at::linalg_vector_norm(at::stack(norms), 2);
  if (max_norm > 0) {
    const at::Tensor coef = at::clamp(max_norm / (total + 1e-6), c10::nullopt, 1.0);
    for (auto& [name, g] : grads) g.mul_(coef);
  }
  return total.item<double>();
}

void adamw_update(at::Tensor& master, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                  const at::Tensor& g, const TrainConfig::Optimizer& o, double lr, int64_t step) {
  const double b1 = o.betas[0], b2 = o.betas[1];
  const double bias1 = 1 - std::pow(b1, static_cast<double>(step));
  const double bias2_sqrt = std::sqrt(1 - std::pow(b2, static_cast<double>(step)));
  const double step_size = lr / bias1;
  at::AutoGradMode no_grad(false);
  if (o.weight_decay != 0) master.mul_(1 - lr * o.weight_decay);
  exp_avg.lerp_(g, 1 - b1);
  exp_avg_sq.mul_(b2).addcmul_(g, g, 1 - b2);
  at::Tensor denom = exp_avg_sq.sqrt();  // one temporary of the tensor's size
  denom.div_(bias2_sqrt).add_(o.eps);
  master.addcdiv_(exp_avg, denom, -step_size);
}

AdamW::AdamW(TrainConfig::Optimizer opt, TrainConfig::Schedule schedule)
    : opt_(opt), schedule_(schedule) {}

void AdamW::init(const std::map<std::string, at::Tensor>& params) {
  master_.clear(), exp_avg_.clear(), exp_avg_sq_.clear();
  for (const auto& [name, p] : params) {
    master_[name] = p.detach().to(at::kFloat).clone();
    exp_avg_[name] = at::zeros_like(master_[name]);
    exp_avg_sq_[name] = at::zeros_like(master_[name]);
  }
  step_ = 0;
}

double AdamW::step(std::map<std::string, at::Tensor>& grads,
                   std::map<std::string, at::Tensor>& params) {
  for (const auto& [name, m] : master_)
    LVX_CHECK(grads.count(name), "optimizer: no gradient for parameter '", name, "'");
  const double norm = clip_grad_norm(grads, opt_.grad_clip);
  if (!std::isfinite(norm)) throw NonFiniteGradient(str("the gradient norm is ", norm));
  const double lr = learning_rate(opt_, schedule_, step_);
  last_lr_ = lr;
  ++step_;
  at::AutoGradMode no_grad(false);
  for (auto& [name, p] : master_) {
    const at::Tensor g = grads.at(name).to(at::kFloat);
    adamw_update(p, exp_avg_.at(name), exp_avg_sq_.at(name), g, opt_, lr, step_);
    at::Tensor& param = params.at(name);
    param.detach().copy_(p);  // cast to the compute dtype (bf16) from the fp32 master
  }
  return norm;
}

std::string AdamW::non_finite_master() const {
  if (master_.empty()) return "";
  std::vector<at::Tensor> finite;
  for (const auto& [name, p] : master_) finite.push_back(at::isfinite(p).all());
  const at::Tensor all = at::stack(finite);
  if (all.all().item<bool>()) return "";
  const at::Tensor ok = all.to(at::kBool);
  size_t i = 0;
  for (const auto& [name, p] : master_)
    if (!ok[static_cast<int64_t>(i++)].item<bool>()) return name;
  return "";
}

std::map<std::string, at::Tensor> AdamW::state_tensors() const {
  std::map<std::string, at::Tensor> t;
  for (const auto& [name, p] : master_) {
    t["master." + name] = p;
    t["exp_avg." + name] = exp_avg_.at(name);
    t["exp_avg_sq." + name] = exp_avg_sq_.at(name);
  }
  return t;
}

void AdamW::load_state(const std::map<std::string, at::Tensor>& tensors, int64_t step,
                       const std::string& where) {
  for (auto* part : {&master_, &exp_avg_, &exp_avg_sq_}) {
    const std::string prefix = part == &master_    ? "master."
                               : part == &exp_avg_ ? "exp_avg."
                                                   : "exp_avg_sq.";
    for (auto& [name, t] : *part) {
      auto it = tensors.find(prefix + name);
      LVX_CHECK(it != tensors.end(), where, ": has no tensor '", prefix, name,
                "' (the checkpoint was written with another freeze policy or model?)");
      LVX_CHECK(it->second.sizes() == t.sizes(), where, ": tensor '", prefix, name, "' has shape ",
                it->second.sizes(), ", the model's parameter has ", t.sizes());
      t = it->second.to(t.device(), at::kFloat).clone();  // beside the parameter it updates
    }
  }
  size_t expected = 3 * master_.size();
  LVX_CHECK(tensors.size() == expected, where, ": holds ", tensors.size(), " tensors, expected ",
            expected, " (3 per trainable parameter; another freeze policy?)");
  step_ = step;
}

}  // namespace lvx::runtime
