// Pieces of `lvx bench-plan`, which checks the planner against this machine: inputs for one
// attention layer in the format of `lvx attention`, that command's stats, and the regret of a
// choice (its measured time over the fastest measured).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>

#include "src/planner/cost_model.h"

namespace lvx::planner {

// Random q [1,Sq,Hq,D], k/v [1,Skv,Hkv,D], do [1,Sq,Hq,D] in `dtype`, and for media layers the
// very metadata the planner counted (q_media int32 [1,Sq], kv_media int32 [1,Skv], from the
// workload's PairCounter, i.e. the prompt layout under the model's rule), so bench-plan measures
// the work that was planned.
std::map<std::string, at::Tensor> layer_inputs(const LayerWorkload& w, at::ScalarType dtype,
                                               uint64_t seed);

// The --mask value of `lvx attention` for a layer.
std::string attention_mask_flag(const LayerWorkload& w);

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
double predicted_bytes_sent(const attention::StrategyChoice& choice, const LayerWorkload& w,
                            const ClusterConfig& c, int n, const CostOptions& opt);

// measured[choice] / min over measured, by choice name ("ring", "lv_xattn+ring"); measured holds
// only what ran. NaN when the choice was not measured.
double regret(const std::map<std::string, double>& measured, const std::string& choice);

}  // namespace lvx::planner
