#include "src/runtime/train_step.h"

#include <algorithm>
#include <sstream>
#include <vector>

#include "src/common/error.h"
#include "src/planner/cluster_config.h"
#include "src/planner/planner.h"

namespace lvx::runtime {

models::Parallel explicit_strategies(const std::string& spec, int64_t layers) {
  std::vector<std::string> parts;
  std::stringstream ss(spec);
  for (std::string p; std::getline(ss, p, ',');) parts.push_back(p);
  LVX_CHECK(parts.size() == 1 || parts.size() == 2, "--strategies: expected auto, S or ",
            "S_cross,S_self, got '", spec, "'");
  models::LayerStrategies ls;
  ls.cross = attention::strategy_choice_from_name(parts[0]);
  ls.self = attention::strategy_choice_from_name(parts.size() == 2 ? parts[1] : parts[0]);
  models::Parallel p;
  p.layers.assign(static_cast<size_t>(layers), ls);
  return p;
}

models::Parallel planned_strategies(const std::string& cluster, const std::string& dtype,
                                    bool train, const models::Model& model,
                                    const at::Tensor& input_ids, int world,
                                    std::string* plan_text) {
  models::Parallel p;
  p.layers.assign(static_cast<size_t>(model.decoder_layers()), models::LayerStrategies{});
  if (cluster.empty()) {
    *plan_text =
        "plan: no cluster config given; lv_xattn for cross-attention, ring for "
        "self-attention";
    return p;
  }
  planner::ModelConfig m = model.planner_model();
  m.dtype = dtype;
  planner::Workload w;
  at::Tensor marks = (input_ids.narrow(0, 0, 1) == model.media_token_id()).to(at::kLong);
  w.frames = std::max<int64_t>(1, marks.sum().item<int64_t>());
  w.text_tokens = input_ids.size(1);
  if (marks.sum().item<int64_t>() > 0) w.prompt_marks = marks;
  w.tokens_per_frame = model.tokens_per_media();
  w.ranks = world;
  w.dtype = dtype;
  w.train = train;
  const planner::Plan plan = planner::plan(m, planner::load_cluster_config(cluster), w);
  // Each decoder layer has one self layer; a cross layer belongs to the decoder layer of the
  // self layer next to it (mPLUG-Owl3: after it, OpenFlamingo: before it).
  const bool cross_first = model.family() == "openflamingo";
  size_t decoder_layer = 0;
  for (const planner::LayerPlan& l : plan.layers) {
    if (l.work.kind == planner::LayerKind::kSelf) {
      p.layers[decoder_layer++].self = l.choice();
    } else {
      p.layers[cross_first ? decoder_layer : decoder_layer - 1].cross = l.choice();
    }
  }
  *plan_text = planner::format_table(plan);
  return p;
}

std::map<std::string, at::Tensor> backward_step(dist::ProcessGroup& pg, models::Model& model,
                                                const at::Tensor& all_labels,
                                                const models::ModelOutputs& out,
                                                const ParamFilter& trains) {
  const at::Tensor labels = all_labels.index_select(1, out.positions);  // this rank's rows
  at::Tensor count = labels.ne(-100).sum().to(at::kDouble).reshape({1});
  pg.all_reduce(count);
  LVX_CHECK(count.item<double>() > 0, "labels: every label is -100 (nothing to learn)");
  const at::Tensor logits = out.logits.to(at::kFloat).reshape({-1, out.logits.size(-1)});
  const at::Tensor local_sum = at::cross_entropy_loss(logits, labels.reshape({-1}), /*weight=*/{},
                                                      at::Reduction::Sum, /*ignore_index=*/-100);
  (local_sum / count.item<double>()).backward();
  std::vector<std::string> names;
  std::vector<at::Tensor> parts;
  for (auto& [name, t] : model.parameters()) {
    if (trains ? !trains(name) : !model.trainable(name)) continue;
    names.push_back(name);
    parts.push_back(t.grad().defined() ? t.grad().to(at::kFloat).reshape({-1})
                                       : at::zeros({t.numel()}, at::kFloat));
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

std::string describe(const models::Parallel& p) {
  std::string s =
      str("text ", p.text_layout == attention::LayoutKind::kStriped ? "striped" : "contiguous");
  for (size_t i = 0; i < p.layers.size(); ++i)
    s += str("; layer ", i, " self ", p.layers[i].self.name(), " cross ", p.layers[i].cross.name());
  return s;
}

}  // namespace lvx::runtime
