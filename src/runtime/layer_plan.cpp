#include "src/runtime/layer_plan.h"

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

namespace {

// Which decoder layers have a cross-attention: the planner's layers in execution order, each
// cross layer belonging to the decoder layer of the self layer next to it (mPLUG-Owl3: after it,
// OpenFlamingo: before it).
std::vector<bool> layers_with_cross(const models::Model& model) {
  std::vector<bool> cross(static_cast<size_t>(model.decoder_layers()), false);
  const bool cross_first = model.family() == "openflamingo";
  size_t decoder_layer = 0;
  for (const planner::AttentionLayerConfig& l : model.planner_model().layers) {
    if (l.kind == planner::LayerKind::kSelf) {
      ++decoder_layer;
    } else {
      cross[cross_first ? decoder_layer : decoder_layer - 1] = true;
    }
  }
  return cross;
}

// auto: the planner's per-layer choice for this input on the cluster config; without one,
// lv_xattn for cross layers and ring for self layers.
models::Parallel planned_strategies(const models::Model& model, const at::Tensor& input_ids,
                                    int world, const PlanRequest& req, std::string* plan_text) {
  models::Parallel p;
  p.layers.assign(static_cast<size_t>(model.decoder_layers()), models::LayerStrategies{});
  if (req.cluster.empty()) {
    *plan_text = "plan: no --cluster given; lv_xattn for cross-attention, ring for self-attention";
    return p;
  }
  planner::ModelConfig m = model.planner_model();
  m.dtype = req.dtype;
  planner::Workload w;
  at::Tensor marks = (input_ids.narrow(0, 0, 1) == model.media_token_id()).to(at::kLong);
  w.frames = std::max<int64_t>(1, marks.sum().item<int64_t>());
  w.text_tokens = input_ids.size(1);
  if (marks.sum().item<int64_t>() > 0) w.prompt_marks = marks;
  w.tokens_per_frame = model.tokens_per_media();
  w.ranks = world;
  w.dtype = req.dtype;
  w.train = req.train;
  const planner::Plan plan = planner::plan(m, planner::load_cluster_config(req.cluster), w);
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

}  // namespace

models::Parallel plan_layers(const models::Model& model, const at::Tensor& input_ids, int world,
                             const PlanRequest& request, std::string* plan_text) {
  models::Parallel p = request.strategies == "auto"
                           ? planned_strategies(model, input_ids, world, request, plan_text)
                           : explicit_strategies(request.strategies, model.decoder_layers());
  if (request.strategies != "auto") *plan_text = "plan: --strategies " + request.strategies;
  return models::resolve_layouts(p);
}

std::string describe(const models::Parallel& p, const models::Model* model) {
  const std::vector<bool> cross = model ? layers_with_cross(*model) : std::vector<bool>{};
  std::string s =
      str("text ", p.text_layout == attention::LayoutKind::kStriped ? "striped" : "contiguous");
  for (size_t i = 0; i < p.layers.size(); ++i) {
    s += str("; layer ", i, " self ", p.layers[i].self.name());
    if (!model || (i < cross.size() && cross[i])) s += str(" cross ", p.layers[i].cross.name());
  }
  return s;
}

}  // namespace lvx::runtime
