// The per-layer strategy planner: for every attention layer of a model on a cluster and a
// workload, estimates each strategy (cost_model.h), picks the fastest feasible one (forward and
// backward separately where both keep the same saved state), and says why.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/planner/cluster_config.h"
#include "src/planner/cost_model.h"
#include "src/planner/model_yaml.h"

namespace lvx::planner {

// Where the frames' image tokens sit in the prompt.
enum class PromptLayout {
  kVideoQA,      // "video_qa": every frame's token first, then the question (video QA prompts)
  kInterleaved,  // "interleaved": frame f's token at position floor(f·S_Q/F) (interleaved text)
};
const char* to_string(PromptLayout l);
PromptLayout prompt_layout_from_string(const std::string& s);  // error lists the valid names

// Bounds on a workload (larger is an error naming the flag): text tokens, and visual tokens
// (frames x tokens per frame), whose per-token mask metadata the planner builds.
constexpr int64_t kMaxPlanTextTokens = int64_t{1} << 24;
constexpr int64_t kMaxPlanVisualTokens = int64_t{1} << 27;

struct Workload {
  int64_t frames = 0;
  int64_t text_tokens = 0;       // S_Q: text length including one <image> token per frame
  int64_t tokens_per_frame = 0;  // 0: the model's visual_tokens_per_frame
  int64_t ranks = 0;             // 0: every GPU of the cluster
  std::string dtype;             // empty: the model's dtype
  bool train = false;
  PromptLayout layout = PromptLayout::kVideoQA;
  // Optional: the actual prompt, int64 [1, S_Q] with 1 where a frame's token sits (overrides
  // `layout`; the runtime plans a batch from its own input_ids this way).
  at::Tensor prompt_marks;
  std::vector<StrategyKind> strategies;  // candidates to choose from (empty: all); all estimated
  bool split_passes = true;  // may choose forward and backward strategies separately (pairs the
                             // runtime can run: attention::can_pair)
};

// The prompt's token ids for the layout (or prompt_marks): 1 for each frame's image token, 0
// elsewhere ([1, S_Q]).
at::Tensor prompt_ids(const Workload& w);

// Builds each layer's workload (LV-XAttn §4 accounting: S_Q = text length for every layer;
// S_KV = text for self layers, frames × tokens per frame for cross layers) and its mask
// metadata: causal positions, or the media indices of the prompt layout under the model's rule
// (media_upto: "every image before the token", media_immediate: "the most recent image, the
// image's own token included"; attention/media_mask.h). Layers of the same shape share one
// PairCounter.
std::vector<LayerWorkload> layer_workloads(const ModelConfig& m, const Workload& w);

struct LayerPlan {
  int index = 0;
  LayerWorkload work;
  std::map<StrategyKind, StrategyCost> costs;      // every strategy, feasible or not
  StrategyKind forward = StrategyKind::kLvXAttn;   // chosen for the forward pass
  StrategyKind backward = StrategyKind::kLvXAttn;  // chosen for the backward (training)
  bool has_runner_up = false;
  StrategyKind runner_up = StrategyKind::kLvXAttn;  // fastest strategy other than the choice
  double time_s = 0;                                // chosen fwd (+ bwd)
  double mem_bytes = 0;
  std::string explanation;
  attention::StrategyChoice choice() const { return {forward, backward}; }
  std::string choice_name() const { return choice().name(); }  // "lv_xattn", "lv_xattn+ring"
};

struct Plan {
  std::string model, cluster;
  Workload workload;
  int64_t ranks = 0;
  CostOptions options;
  std::vector<LayerPlan> layers;
  double total_s = 0;
  double shared_visual_bytes = 0;  // y kept once for every cross layer (training, recompute)
  double peak_mem_bytes = 0;       // saved activations of all layers + largest working set
  bool fits = true;
};

// Estimates every strategy for one layer on `ranks` ranks and picks the fastest feasible one among
// `strategies` (empty: all), forward and backward separately when split_passes; explains why.
LayerPlan plan_layer(int index, const LayerWorkload& work, const ClusterConfig& c, int64_t ranks,
                     const CostOptions& opt, bool split_passes,
                     const std::vector<StrategyKind>& strategies = {});

// Plans every layer. Errors (lvx::Error) name the bad argument; a layer with no feasible
// strategy is an error naming the layer and every strategy's reason.
Plan plan(const ModelConfig& m, const ClusterConfig& c, const Workload& w,
          const CostOptions& opt = {});

// Time of a layer if every layer used `s` (the uniform-strategy baselines in the summary);
// infeasible layers count +inf.
double uniform_time(const Plan& p, StrategyKind s, LayerKind kind);

nlohmann::json to_json(const Plan& p);
// The human-readable table: one row per layer, each strategy's time and memory, the choice and
// the runner-up, then the explanations and totals.
std::string format_table(const Plan& p);

}  // namespace lvx::planner
