#include "src/runtime/layer_plan.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <vector>

#include "kernels/cpu_path.h"
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

// The decoder layer and side of each of the planner's layers (Model::planner_model().layers, in
// execution order), from the model's own description of its layers (Model::layer_attentions): a
// decoder layer lists its self- and cross-attention in the order they run, or only the one it
// has. A mismatch between the two descriptions is an error naming both counts.
struct PlannerLayerSlot {
  size_t decoder_layer = 0;
  bool cross = false;
};
std::vector<PlannerLayerSlot> planner_layer_slots(const models::Model& model,
                                                  const std::vector<planner::LayerKind>& kinds) {
  const std::vector<models::DecoderLayerAttention> attn = model.layer_attentions();
  LVX_CHECK(static_cast<int64_t>(attn.size()) == model.decoder_layers(), "the model describes ",
            attn.size(), " decoder layers' attentions but has ", model.decoder_layers(),
            " decoder layers");
  std::vector<PlannerLayerSlot> slots;
  for (size_t i = 0; i < attn.size(); ++i) {
    const models::DecoderLayerAttention& a = attn[i];
    LVX_CHECK(a.self || a.cross, "decoder layer ", i, " has neither a self- nor a cross-attention");
    if (a.cross && a.cross_first) slots.push_back({i, true});
    if (a.self) slots.push_back({i, false});
    if (a.cross && !a.cross_first) slots.push_back({i, true});
  }
  LVX_CHECK(slots.size() == kinds.size(), "the planner describes ", kinds.size(),
            " attention layers but the model's decoder layers run ", slots.size());
  for (size_t k = 0; k < kinds.size(); ++k)
    LVX_CHECK((kinds[k] == planner::LayerKind::kCross) == slots[k].cross, "attention layer ", k,
              " is a ", kinds[k] == planner::LayerKind::kCross ? "cross" : "self",
              "-attention in the planner's description but a ", slots[k].cross ? "cross" : "self",
              "-attention of decoder layer ", slots[k].decoder_layer, " in the model's");
  return slots;
}

// The CPU attention path per block shape that `lvx calibrate` measured into the config
// (kernels/cpu_path.h); nothing when the config has none (GPU configs, nominal ones).
void apply_cpu_attention(const planner::ClusterConfig& cluster) {
  if (cluster.cpu_attention.empty()) return;
  std::vector<kernels::CpuPathChoice> choices;
  for (const planner::CpuAttentionChoice& c : cluster.cpu_attention)
    choices.push_back({c.skv_over_sq, kernels::cpu_path_from_name(c.path, "cpu_attention.path")});
  kernels::set_cpu_attention_choices(std::move(choices));
}

// The cluster config at `path`, read once and again only when the file changes (its size or
// modification time): lvx finetune plans every sample and lvx serve every request, and reading
// and checking the YAML each time cost a file read and a parse per sample.
std::shared_ptr<const planner::ClusterConfig> cluster_config(const std::string& path) {
  struct Entry {
    std::filesystem::file_time_type mtime;
    uintmax_t size = 0;
    std::shared_ptr<const planner::ClusterConfig> config;
  };
  static std::mutex mu;
  static std::map<std::string, Entry> read;
  std::error_code ec;
  const auto mtime = std::filesystem::last_write_time(path, ec);
  const uintmax_t size = ec ? 0 : std::filesystem::file_size(path, ec);
  std::lock_guard<std::mutex> lock(mu);
  auto it = read.find(path);
  if (!ec && it != read.end() && it->second.mtime == mtime && it->second.size == size)
    return it->second.config;
  auto config = std::make_shared<const planner::ClusterConfig>(planner::load_cluster_config(path));
  if (!ec) read[path] = Entry{mtime, size, config};
  return config;
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
  const std::shared_ptr<const planner::ClusterConfig> cluster = cluster_config(req.cluster);
  apply_cpu_attention(*cluster);
  const planner::Plan plan = planner::plan(m, *cluster, w);
  // Each of the planner's layers is one attention of a decoder layer (Model::layer_attentions).
  std::vector<planner::LayerKind> kinds;
  for (const planner::LayerPlan& l : plan.layers) kinds.push_back(l.work.kind);
  const std::vector<PlannerLayerSlot> slots = planner_layer_slots(model, kinds);
  for (size_t k = 0; k < slots.size(); ++k) {
    models::LayerStrategies& ls = p.layers[slots[k].decoder_layer];
    (slots[k].cross ? ls.cross : ls.self) = plan.layers[k].choice();
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
  const std::vector<models::DecoderLayerAttention> attn =
      model ? model->layer_attentions() : std::vector<models::DecoderLayerAttention>{};
  std::string s =
      str("text ", p.text_layout == attention::LayoutKind::kStriped ? "striped" : "contiguous");
  for (size_t i = 0; i < p.layers.size(); ++i) {
    // With the model: only the attentions the layer has.
    const bool self = !model || i >= attn.size() || attn[i].self;
    const bool cross = !model || (i < attn.size() && attn[i].cross);
    s += str("; layer ", i);
    if (self) s += str(" self ", p.layers[i].self.name());
    if (cross) s += str(" cross ", p.layers[i].cross.name());
  }
  return s;
}

}  // namespace lvx::runtime
