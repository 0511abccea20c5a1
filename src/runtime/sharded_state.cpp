#include "src/runtime/sharded_state.h"

#include <ATen/core/grad_mode.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "src/common/error.h"
#include "src/common/safetensors.h"
#include "src/runtime/optimizer.h"

namespace lvx::runtime {

namespace fs = std::filesystem;

ShardStage shard_stage_from_string(const std::string& s, const std::string& field) {
  if (s == "none") return ShardStage::kNone;
  if (s == "optimizer") return ShardStage::kOptimizer;
  if (s == "gradients") return ShardStage::kGradients;
  if (s == "parameters") return ShardStage::kParameters;
  LVX_FAIL(field, ": expected none | optimizer | gradients | parameters, got '", s, "'");
}

const char* shard_stage_name(ShardStage s) {
  switch (s) {
    case ShardStage::kNone:
      return "none";
    case ShardStage::kOptimizer:
      return "optimizer";
    case ShardStage::kGradients:
      return "gradients";
    case ShardStage::kParameters:
      return "parameters";
  }
  return "?";
}

nlohmann::json FlatLayout::to_json() const {
  nlohmann::json j = nlohmann::json::array();
  for (size_t i = 0; i < names.size(); ++i)
    j.push_back(nlohmann::json::array({names[i], offsets[i + 1] - offsets[i]}));
  return j;
}

FlatLayout FlatLayout::from_json(const nlohmann::json& j, const std::string& where) {
  LVX_CHECK(j.is_array(), where, ": expected the layout as [[name, numel], ...]");
  FlatLayout l;
  for (const auto& e : j) {
    LVX_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_number_integer() &&
                  e[1].get<int64_t>() >= 0,
              where, ": layout entry ", e.dump(), " is not [name, numel]");
    l.names.push_back(e[0].get<std::string>());
    l.offsets.push_back(l.offsets.back() + e[1].get<int64_t>());
  }
  return l;
}

FlatLayout flat_layout(const std::map<std::string, at::Tensor>& trainable) {
  FlatLayout l;
  for (const auto& [name, t] : trainable) {
    l.names.push_back(name);
    l.offsets.push_back(l.offsets.back() + t.numel());
  }
  return l;
}

at::Tensor flat_slice(const std::map<std::string, at::Tensor>& params, const FlatLayout& layout,
                      int64_t begin, int64_t end) {
  LVX_CHECK(!params.empty(), "flat_slice: no parameters");
  at::Tensor out = at::empty({end - begin}, params.begin()->second.options().dtype(at::kFloat));
  for (size_t i = 0; i < layout.names.size(); ++i) {
    const int64_t b = std::max(begin, layout.offsets[i]), e = std::min(end, layout.offsets[i + 1]);
    if (b >= e) continue;
    const at::Tensor p = params.at(layout.names[i]).detach().reshape({-1});
    out.narrow(0, b - begin, e - b).copy_(p.narrow(0, b - layout.offsets[i], e - b));
  }
  return out;
}

ShardedAdamW::ShardedAdamW(TrainConfig::Optimizer opt, TrainConfig::Schedule schedule,
                           FlatLayout layout, int world, int rank)
    : opt_(opt), schedule_(schedule), layout_(std::move(layout)), world_(world), rank_(rank) {
  std::tie(begin_, end_) = dist::shard_range(layout_.numel(), world_, rank_);
}

void ShardedAdamW::init(const std::map<std::string, at::Tensor>& params) {
  master_ = flat_slice(params, layout_, begin_, end_);
  exp_avg_ = at::zeros_like(master_);
  exp_avg_sq_ = at::zeros_like(master_);
  step_ = 0;
}

void ShardedAdamW::init(const std::function<at::Tensor(const std::string&)>& read,
                        const at::Device& device) {
  master_ = at::zeros({end_ - begin_}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (size_t i = 0; read && i < layout_.names.size(); ++i) {
    const int64_t b = std::max(begin_, layout_.offsets[i]),
                  e = std::min(end_, layout_.offsets[i + 1]);
    if (b >= e) continue;
    const at::Tensor p = read(layout_.names[i]).reshape({-1});  // one whole tensor at a time
    master_.narrow(0, b - begin_, e - b).copy_(p.narrow(0, b - layout_.offsets[i], e - b));
  }
  exp_avg_ = at::zeros_like(master_);
  exp_avg_sq_ = at::zeros_like(master_);
  step_ = 0;
}

void reduce_into_shard(dist::ProcessGroup& pg, int64_t numel, int64_t offset, at::Tensor& part,
                       at::Tensor& shard, int64_t shard_begin) {
  const int n = pg.world_size();
  std::vector<int64_t> splits(static_cast<size_t>(n));
  int64_t mine_b = 0, mine_e = 0;
  for (int q = 0; q < n; ++q) {
    const auto [b, e] = dist::shard_range(numel, n, q);
    const int64_t lo = std::clamp(b, offset, offset + part.numel()),
                  hi = std::clamp(e, offset, offset + part.numel());
    splits[static_cast<size_t>(q)] = hi - lo;
    if (q == pg.rank()) mine_b = lo, mine_e = hi;
  }
  const at::Tensor mine = pg.reduce_scatter(part, splits);
  if (mine_e > mine_b) shard.narrow(0, mine_b - shard_begin, mine_e - mine_b).add_(mine);
}

double ShardedAdamW::step(dist::ProcessGroup& pg, at::Tensor g,
                          std::map<std::string, at::Tensor>* params) {
  LVX_CHECK(g.numel() == end_ - begin_, "sharded optimizer: gradient shard has ", g.numel(),
            " elements, this rank owns ", end_ - begin_);
  at::AutoGradMode no_grad(false);
  g = g.to(at::kFloat);
  // The global L2 norm: every rank's sum of squares (from its shard's norm, no copy of the
  // shard), summed over the ranks in fp64.
  const double local = at::linalg_vector_norm(g, 2).item<double>();
  at::Tensor sq = at::full({1}, local * local, g.options().dtype(at::kDouble));
  pg.all_reduce(sq);
  const double norm = std::sqrt(sq.item<double>());
  if (!std::isfinite(norm)) throw NonFiniteGradient(str("the gradient norm is ", norm));
  if (opt_.grad_clip > 0) {
    // As clip_grad_norm_: max_norm / (norm + 1e-6) in fp32, clamped to 1.
    const float coef =
        std::min(1.0f, static_cast<float>(opt_.grad_clip) / (static_cast<float>(norm) + 1e-6f));
    g.mul_(coef);
  }
  const double lr = learning_rate(opt_, schedule_, step_);
  last_lr_ = lr;
  ++step_;
  adamw_update(master_, exp_avg_, exp_avg_sq_, g, opt_, lr, step_);
  if (params == nullptr) return norm;  // stage 3: parameters are gathered from the masters
  // Every rank's updated shard, in the parameters' dtype, into every rank's parameters.
  const at::ScalarType dtype = params->at(layout_.names.front()).scalar_type();
  std::vector<int64_t> sizes(static_cast<size_t>(world_));
  for (int r = 0; r < world_; ++r) {
    const auto [b, e] = dist::shard_range(layout_.numel(), world_, r);
    sizes[static_cast<size_t>(r)] = e - b;
  }
  const at::Tensor full = pg.all_gather(master_.to(dtype), sizes);
  for (size_t i = 0; i < layout_.names.size(); ++i) {
    at::Tensor p = params->at(layout_.names[i]).detach();
    p.copy_(full.narrow(0, layout_.offsets[i], layout_.offsets[i + 1] - layout_.offsets[i])
                .view(p.sizes()));
  }
  return norm;
}

std::string ShardedAdamW::non_finite_master(dist::ProcessGroup& pg) const {
  // The first non-finite flat index on any rank (numel when none).
  const int64_t n = layout_.numel();
  int64_t first = n;
  const at::Tensor bad = at::isfinite(master_).logical_not().nonzero();
  if (bad.numel() > 0) first = begin_ + bad[0][0].item<int64_t>();
  at::Tensor t = at::tensor({first}, at::kLong);
  pg.all_reduce(t, dist::ReduceOp::kMin);
  first = t.item<int64_t>();
  if (first >= n) return "";
  for (size_t i = 0; i < layout_.names.size(); ++i)
    if (first < layout_.offsets[i + 1]) return layout_.names[i];
  return "";
}

std::map<std::string, at::Tensor> ShardedAdamW::state_tensors() const {
  return {{"master", master_}, {"exp_avg", exp_avg_}, {"exp_avg_sq", exp_avg_sq_}};
}

void ShardedAdamW::load(const std::string& ckpt, const FlatLayout& saved, int64_t step) {
  LVX_CHECK(saved == layout_, ckpt, "/trainer_state.json: the optimizer layout (",
            saved.names.size(), " parameters, ", saved.numel(), " elements) differs from this ",
            "run's trainable parameters (", layout_.names.size(), ", ", layout_.numel(),
            "): the checkpoint was written with another freeze policy or model");
  auto s = load_flat_optimizer_state(ckpt, layout_, begin_, end_);
  const at::Device d = master_.defined() ? master_.device() : at::Device(at::kCPU);
  master_ = s.at("master").to(d);
  exp_avg_ = s.at("exp_avg").to(d);
  exp_avg_sq_ = s.at("exp_avg_sq").to(d);
  step_ = step;
}

std::string optimizer_shard_name(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "optimizer-%05d-of-%05d.safetensors", rank, world);
  return buf;
}

void save_optimizer_shard(const std::string& dir, const ShardedAdamW& opt, int world, int rank,
                          int64_t step) {
  std::map<std::string, at::Tensor> t;
  for (auto& [k, v] : opt.state_tensors()) t[k] = v.to(at::kCPU);
  save_safetensors((fs::path(dir) / optimizer_shard_name(rank, world)).string(), t,
                   {{"step", std::to_string(step)},
                    {"begin", std::to_string(opt.begin())},
                    {"end", std::to_string(opt.end())},
                    {"numel", std::to_string(opt.layout().numel())}});
}

std::map<std::string, at::Tensor> load_flat_optimizer_state(const std::string& ckpt,
                                                            const FlatLayout& layout, int64_t begin,
                                                            int64_t end) {
  static const char* kParts[] = {"master", "exp_avg", "exp_avg_sq"};
  std::map<std::string, at::Tensor> out;
  for (const char* k : kParts) out[k] = at::empty({end - begin}, at::kFloat);
  const fs::path consolidated = fs::path(ckpt) / "optimizer.safetensors";
  if (fs::exists(consolidated)) {
    // A `none` run's per-parameter state: only the parameters that overlap [begin, end).
    std::vector<std::string> wanted;
    for (size_t i = 0; i < layout.names.size(); ++i)
      if (layout.offsets[i] < end && layout.offsets[i + 1] > begin)
        for (const char* k : kParts) wanted.push_back(std::string(k) + "." + layout.names[i]);
    const TensorFile f = load_safetensors(consolidated.string(), wanted);
    for (size_t i = 0; i < layout.names.size(); ++i) {
      const int64_t b = std::max(begin, layout.offsets[i]),
                    e = std::min(end, layout.offsets[i + 1]);
      if (b >= e) continue;
      for (const char* k : kParts) {
        const at::Tensor& t = f.tensors.at(std::string(k) + "." + layout.names[i]);
        LVX_CHECK(t.numel() == layout.offsets[i + 1] - layout.offsets[i], consolidated.string(),
                  ": tensor '", k, ".", layout.names[i], "' has ", t.numel(),
                  " elements, the model's parameter has ",
                  layout.offsets[i + 1] - layout.offsets[i]);
        out[k]
            .narrow(0, b - begin, e - b)
            .copy_(t.reshape({-1}).narrow(0, b - layout.offsets[i], e - b));
      }
    }
    return out;
  }
  // Shard files of whatever world size wrote them: each holds [begin, end) in its metadata.
  std::vector<fs::path> shards;
  for (const auto& e : fs::directory_iterator(ckpt)) {
    const std::string n = e.path().filename().string();
    if (n.rfind("optimizer-", 0) == 0 && n.find("-of-") != std::string::npos && n.size() > 12 &&
        n.substr(n.size() - 12) == ".safetensors")
      shards.push_back(e.path());
  }
  LVX_CHECK(!shards.empty(), ckpt, ": has neither optimizer.safetensors nor optimizer-*-of-*",
            ".safetensors (not a fine-tuning checkpoint?)");
  int64_t covered = 0;
  for (const fs::path& p : shards) {
    const TensorFile f = load_safetensors(p.string());
    auto meta = [&](const char* k) {
      auto it = f.metadata.find(k);
      LVX_CHECK(it != f.metadata.end(), p.string(), ": metadata has no '", k, "'");
      return std::stoll(it->second);
    };
    const int64_t fb = meta("begin"), fe = meta("end");
    LVX_CHECK(meta("numel") == layout.numel() && fb >= 0 && fb <= fe && fe <= layout.numel(),
              p.string(), ": holds elements [", fb, ", ", fe, ") of ", meta("numel"),
              ", the trainable parameters have ", layout.numel());
    const int64_t b = std::max(begin, fb), e = std::min(end, fe);
    if (b >= e) continue;
    for (const char* k : kParts) {
      auto it = f.tensors.find(k);
      LVX_CHECK(it != f.tensors.end() && it->second.numel() == fe - fb, p.string(), ": tensor '", k,
                "' missing or not ", fe - fb, " elements");
      out[k].narrow(0, b - begin, e - b).copy_(it->second.narrow(0, b - fb, e - b));
    }
    covered += e - b;
  }
  LVX_CHECK(covered == end - begin, ckpt, ": the optimizer shard files cover ", covered, " of the ",
            end - begin, " elements [", begin, ", ", end, ") (a shard file is missing)");
  return out;
}

}  // namespace lvx::runtime
