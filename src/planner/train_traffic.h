// The data-parallel and ZeRO traffic of one optimizer step of `lvx finetune`, as the engines'
// collectives move it (src/dist/collectives.cpp: NCCL's ring on GPUs), priced on a cluster's
// links for `lvx plan --train`. Which collectives a stage runs, per optimizer step, for Ψ
// trainable elements, A samples per rank (grad_accum), s_p bytes per parameter element
// (src/runtime/sharded_state.h):
//   none        A all-reduces of the fp32 gradients (4Ψ)
//   optimizer   one reduce-scatter of the fp32 gradients (4Ψ), one all-gather of the parameters
//               (s_p·Ψ)
//   gradients   A reduce-scatters (4Ψ), one all-gather (s_p·Ψ)
//   parameters  A reduce-scatters (4Ψ) and A all-gathers of the parameters for the forward and
//               the backward (s_p·(2Ψ − Ψ_last): the last layer stays gathered), none after the
//               update
// A collective of S bytes over n ranks on N nodes of L ranks (N = ⌈n/L⌉) costs, as a
// hierarchical ring does (NCCL's rings cross every node's links in parallel channels, so a node
// is one ring member on the slow link):
//   t = max(f·(L−1)/L·S / B_intra, f·(N−1)/N·S / B_inter) + f·(n−1)·α
// with f = 2 for all-reduce (reduce-scatter + all-gather) and 1 otherwise, B_inter a node's
// link, α the latency of the slowest link crossed. Bytes sent per rank are the ring's:
// f·(n−1)/n·S. Not overlapped with compute (lvx waits for each collective); stage 3's gathers
// of the next layer are (layer_sharding.h), so its figure is an upper bound.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/planner/cluster_config.h"
#include "src/planner/train_memory.h"

namespace lvx::planner {

enum class CollectiveKind { kAllReduce, kReduceScatter, kAllGather };

// Seconds of one collective of `bytes` (the whole buffer, S above) over `ranks` ranks of
// `cluster` (filling its nodes in order).
double collective_seconds(CollectiveKind kind, double bytes, int64_t ranks,
                          const ClusterConfig& cluster);
// Bytes one rank sends in it (ring).
double collective_bytes_sent(CollectiveKind kind, double bytes, int64_t ranks);

struct TrafficItem {
  std::string what;  // e.g. "reduce_scatter fp32 gradients"
  CollectiveKind kind = CollectiveKind::kAllReduce;
  double bytes = 0;    // S of one call
  int64_t calls = 0;   // per optimizer step
  double sent = 0;     // bytes one rank sends per step
  double seconds = 0;  // per step
};

struct TrainTraffic {
  std::vector<TrafficItem> items;
  double sent = 0, seconds = 0;  // per optimizer step
};

// Ψ: params.trainable, or LoRA's adapters (o.lora_r > 0; Ψ_last then an even share per decoder
// layer); Ψ_last otherwise params.max_block.
TrainTraffic train_traffic(const ModelConfig& m, const ParamCounts& params,
                           const TrainMemoryOptions& o, const ClusterConfig& cluster);

nlohmann::json to_json(const TrainTraffic& t);
std::string format_traffic(const TrainTraffic& t, const TrainMemoryOptions& o);

}  // namespace lvx::planner
