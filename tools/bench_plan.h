// The harness of `lvx bench-plan`, which checks the planner against this machine: inputs for one
// attention layer in the format of `lvx attention`, that command's stats, the regret of a choice
// (its measured time over the fastest measured), and the runs of `lvx attention` and `lvx
// calibrate` on local ranks that measure every strategy of a plan (src/cli/cmd_bench_plan.cpp
// parses the flags and prints).
#pragma once

#include <ATen/ATen.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "src/planner/cost_model.h"
#include "src/planner/planner.h"
#include "tools/bench_plot.h"

namespace lvx::tools {

// Random q [1,Sq,Hq,D], k/v [1,Skv,Hkv,D], do [1,Sq,Hq,D] in `dtype`, and for media layers the
// very metadata the planner counted (q_media int32 [1,Sq], kv_media int32 [1,Skv], from the
// workload's PairCounter, i.e. the prompt layout under the model's rule), so bench-plan measures
// the work that was planned.
std::map<std::string, at::Tensor> layer_inputs(const planner::LayerWorkload& w,
                                               at::ScalarType dtype, uint64_t seed);

// The --mask value of `lvx attention` for a layer.
std::string attention_mask_flag(const planner::LayerWorkload& w);

// stats.json of `lvx attention`: {"strategy": S, "ranks": [{"rank", "bytes_sent",
// "bytes_received", "seconds"}, ...], "step_seconds_min": …}. Returns the fastest timed call
// (step_seconds_min: each call's time is its slowest rank's; else the slowest rank's median
// seconds) and the largest
// bytes_sent (errors name the file and the field).
struct AttentionRunStats {
  double seconds = 0;
  double bytes_sent = 0;
};
AttentionRunStats read_attention_stats(const std::string& path);

// The largest forward+backward bytes any one rank sends under `choice` (the forward strategy's
// schedule plus the backward's, per rank, as the cost model sees the layer on n ranks of `c`):
// what `lvx attention`'s largest bytes_sent measures. (The per-pass maxima of StrategyCost may
// come from different ranks, e.g. distflash's.)
double predicted_bytes_sent(const attention::StrategyChoice& choice,
                            const planner::LayerWorkload& w, const planner::ClusterConfig& c, int n,
                            const planner::CostOptions& opt);

// measured[choice] / min over measured, by choice name ("ring", "lv_xattn+ring"); measured holds
// only what ran. NaN when the choice was not measured.
double regret(const std::map<std::string, double>& measured, const std::string& choice);

// ---- the harness of `lvx bench-plan`: runs `lvx attention` / `lvx calibrate` on local ranks ----

// The state of one `lvx bench-plan` run: where it works, how it measures, what it measured.
struct Bench {
  std::string self;
  std::filesystem::path dir;
  // An emulated cluster (src/dist/emulated_cluster.h): `lvx launch` options (--nodes K
  // --inter-node R [--intra-node R]) every `lvx attention` run goes through, and `lvx calibrate`
  // takes too. Empty: plain local ranks.
  std::vector<std::string> links;
  int reps = 3;
  int rounds = 2;
  at::ScalarType dtype = at::kFloat;
  std::map<std::string, std::map<std::string, AttentionRunStats>> measured_by_key;
  std::map<std::string, double> noise_by_key;  // layers of one shape are measured once
  nlohmann::json layers = nlohmann::json::array();
  std::vector<Point> points;
  std::vector<double> regrets;
  double sum_choice = 0, sum_best = 0;
  std::vector<double> noise;  // per layer: the choice's slowest round / its fastest − 1
  std::ostringstream table;
};

// Measures every feasible strategy of each planned layer (and the planned pair) in rounds, once
// per distinct layer shape (keys prefixed by `prefix`), and adds rows to b's table, JSON and
// points.
void measure_plan(Bench& b, const std::vector<planner::LayerPlan>& plan,
                  const planner::ClusterConfig& cluster, const planner::CostOptions& opt,
                  int64_t nproc, const std::string& prefix);

// Runs `lvx calibrate --nproc nproc` (with b.links: on that emulated cluster) into b.dir;
// returns the cluster YAML's path.
std::string calibrate(const Bench& b, int64_t nproc);

// The grid of single layers `--grid` measures: causal self-attention (short, long) and
// cross-attention with few and many queries against many keys.
std::vector<planner::LayerWorkload> grid_layers();

}  // namespace lvx::tools
