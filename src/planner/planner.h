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
#include "src/planner/model_config.h"

namespace lvx::planner {

struct Workload {
  int64_t frames = 0;
  int64_t text_tokens = 0;       // S_Q: text length including one <image> token per frame
  int64_t tokens_per_frame = 0;  // 0: the model's visual_tokens_per_frame
  int64_t ranks = 0;             // 0: every GPU of the cluster
  std::string dtype;             // empty: the model's dtype
  bool train = false;
  std::vector<Strategy> strategies;  // candidates to choose from (empty: all); all are estimated
  bool split_passes = true;          // may choose forward and backward strategies separately
};

// Builds each layer's workload (LV-XAttn §4 accounting: S_Q = text length for every layer;
// S_KV = text for self layers, frames × tokens per frame for cross layers) and its mask density:
// causal 1/2; media_upto (every earlier frame) 1/2 for frames spread evenly over the text;
// media_immediate (one frame) 1/frames.
std::vector<LayerWorkload> layer_workloads(const ModelConfig& m, const Workload& w);

struct LayerPlan {
  int index = 0;
  LayerWorkload work;
  std::map<Strategy, StrategyCost> costs;  // every strategy, feasible or not
  Strategy forward = Strategy::kLocal;     // chosen for the forward pass
  Strategy backward = Strategy::kLocal;    // chosen for the backward (training)
  bool has_runner_up = false;
  Strategy runner_up = Strategy::kLocal;  // fastest strategy other than the choice
  double time_s = 0;                      // chosen fwd (+ bwd)
  double mem_bytes = 0;
  std::string explanation;
  std::string choice_name() const;  // "lv_xattn", or "lv_xattn+ring" (forward+backward)
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

// Plans every layer. Errors (lvx::Error) name the bad argument; a layer with no feasible
// strategy is an error naming the layer and every strategy's reason.
Plan plan(const ModelConfig& m, const ClusterConfig& c, const Workload& w,
          const CostOptions& opt = {});

// Time of a layer if every layer used `s` (the uniform-strategy baselines in the summary);
// infeasible layers count +inf.
double uniform_time(const Plan& p, Strategy s, LayerKind kind);

nlohmann::json to_json(const Plan& p);
// The human-readable table: one row per layer, each strategy's time and memory, the choice and
// the runner-up, then the explanations and totals.
std::string format_table(const Plan& p);

}  // namespace lvx::planner
