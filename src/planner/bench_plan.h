// Pieces of `lvx bench-plan`, which checks the planner against this machine: inputs for one
// attention layer in the format of `lvx attention`, that command's stats, and the regret of a
// choice (its measured time over the fastest measured).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>

#include "src/planner/cost_model.h"

namespace lvx::planner {

// Random q [1,Sq,Hq,D], k/v [1,Skv,Hkv,D], do [1,Sq,Hq,D] in `dtype`, and for cross layers the
// media metadata of `lvx attention`: q_media int32 [1,Sq] (frames spread evenly over the text:
// token t follows frame floor(t·F/Sq)) and kv_media int32 [1,Skv] (key j belongs to frame
// floor(j / tokens_per_frame)).
std::map<std::string, at::Tensor> layer_inputs(const LayerWorkload& w, int64_t frames,
                                               at::ScalarType dtype, uint64_t seed);

// The --mask value of `lvx attention` for a layer.
std::string attention_mask_flag(const LayerWorkload& w);

// stats.json of `lvx attention`: {"strategy": S, "ranks": [{"rank", "bytes_sent",
// "bytes_received", "seconds"}, ...]}. Returns the slowest rank's seconds and the largest
// bytes_sent (errors name the file and the field).
struct AttentionRunStats {
  double seconds = 0;
  double bytes_sent = 0;
};
AttentionRunStats read_attention_stats(const std::string& path);

// measured[choice] / min over measured; measured holds only the strategies that ran.
double regret(const std::map<Strategy, double>& measured, Strategy choice);

}  // namespace lvx::planner
