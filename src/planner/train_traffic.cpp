#include "src/planner/train_traffic.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "src/common/error.h"

namespace lvx::planner {

namespace {

double phases(CollectiveKind kind) { return kind == CollectiveKind::kAllReduce ? 2.0 : 1.0; }

const char* kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kAllGather:
      return "all_gather";
  }
  return "?";
}

std::string human_bytes(double b) {
  char buf[32];
  if (b >= 1e9)
    std::snprintf(buf, sizeof(buf), "%.2f GB", b / 1e9);
  else
    std::snprintf(buf, sizeof(buf), "%.1f MB", b / 1e6);
  return buf;
}

TrafficItem item(const std::string& what, CollectiveKind kind, double bytes, int64_t calls,
                 int64_t ranks, const ClusterConfig& c) {
  TrafficItem t;
  t.what = std::string(kind_name(kind)) + " " + what;
  t.kind = kind;
  t.bytes = bytes;
  t.calls = calls;
  t.sent = static_cast<double>(calls) * collective_bytes_sent(kind, bytes, ranks);
  t.seconds = static_cast<double>(calls) * collective_seconds(kind, bytes, ranks, c);
  return t;
}

}  // namespace

double collective_bytes_sent(CollectiveKind kind, double bytes, int64_t ranks) {
  if (ranks <= 1) return 0;
  return phases(kind) * static_cast<double>(ranks - 1) / static_cast<double>(ranks) * bytes;
}

double collective_seconds(CollectiveKind kind, double bytes, int64_t ranks,
                          const ClusterConfig& c) {
  if (ranks <= 1) return 0;
  const int64_t per_node = std::max<int64_t>(1, std::min(ranks, c.gpus_per_node));
  const int64_t nodes = (ranks + per_node - 1) / per_node;
  const double f = phases(kind);
  double t = 0;
  if (per_node > 1) {
    LVX_CHECK(c.intra_node.bandwidth_bytes_per_s > 0, "cluster '", c.name,
              "': intra_node bandwidth must be positive");
    t = f * (per_node - 1.0) / per_node * bytes / c.intra_node.bandwidth_bytes_per_s;
  }
  if (nodes > 1) {
    LVX_CHECK(c.inter_node.bandwidth_bytes_per_s > 0, "cluster '", c.name,
              "': inter_node bandwidth must be positive");
    t = std::max(t, f * (nodes - 1.0) / nodes * bytes / c.inter_node.bandwidth_bytes_per_s);
  }
  const double alpha = nodes > 1 ? c.inter_node.latency_s : c.intra_node.latency_s;
  return t + f * static_cast<double>(ranks - 1) * alpha;
}

TrainTraffic train_traffic(const ModelConfig& m, const ParamCounts& params,
                           const TrainMemoryOptions& o, const ClusterConfig& c) {
  const bool lora = o.lora_r > 0;
  const double psi = lora ? static_cast<double>(lora_parameters(m, o.lora_r))
                          : static_cast<double>(params.trainable);
  const int64_t blocks = m.count(LayerKind::kSelf);
  const double last = lora ? psi / static_cast<double>(std::max<int64_t>(1, blocks))
                           : static_cast<double>(params.max_block);
  const double e = static_cast<double>(o.elem_bytes);
  const double pe = lora ? 4 : e;  // a LoRA adapter is fp32
  const double grads = 4 * psi, weights = pe * psi;
  // Stage 3 also gathers the decoder layers' frozen parameters (a LoRA run's base model), every
  // layer for the forward and the backward but the last (kept): src/runtime/layer_sharding.h.
  const double root = lora ? 0 : static_cast<double>(params.root);
  const double frozen = lora ? static_cast<double>(params.layers)
                             : std::max(0.0, static_cast<double>(params.layers) - (psi - root));
  const double frozen_last = lora ? static_cast<double>(params.max_layer)
                                  : std::max(0.0, static_cast<double>(params.max_layer) - last);
  const int64_t a = o.grad_accum, n = o.ranks;
  TrainTraffic t;
  if (o.shard == "none") {
    t.items.push_back(item("fp32 gradients", CollectiveKind::kAllReduce, grads, a, n, c));
  } else if (o.shard == "optimizer" || o.shard == "gradients") {
    t.items.push_back(item("fp32 gradients", CollectiveKind::kReduceScatter, grads,
                           o.shard == "optimizer" ? 1 : a, n, c));
    t.items.push_back(
        item("parameters after the update", CollectiveKind::kAllGather, weights, 1, n, c));
  } else {
    LVX_CHECK(o.shard == "parameters", "shard: expected none|optimizer|gradients|parameters, got '",
              o.shard, "'");
    t.items.push_back(item("fp32 gradients", CollectiveKind::kReduceScatter, grads, a, n, c));
    t.items.push_back(item("parameters for forward and backward", CollectiveKind::kAllGather,
                           pe * std::max(0.0, 2 * psi - last), a, n, c));
    if (frozen > 0)
      t.items.push_back(item("frozen layers for forward and backward", CollectiveKind::kAllGather,
                             e * std::max(0.0, 2 * frozen - frozen_last), a, n, c));
  }
  for (const TrafficItem& i : t.items) {
    t.sent += i.sent;
    t.seconds += i.seconds;
  }
  return t;
}

nlohmann::json to_json(const TrainTraffic& t) {
  nlohmann::json items = nlohmann::json::array();
  for (const TrafficItem& i : t.items)
    items.push_back({{"what", i.what},
                     {"bytes_per_call", i.bytes},
                     {"calls", i.calls},
                     {"bytes_sent_per_rank", i.sent},
                     {"seconds", i.seconds}});
  return {{"collectives", items}, {"bytes_sent_per_rank", t.sent}, {"seconds", t.seconds}};
}

std::string format_traffic(const TrainTraffic& t, const TrainMemoryOptions& o) {
  std::ostringstream os;
  os << "data-parallel traffic per optimizer step (shard " << o.shard << ", " << o.ranks
     << " ranks, grad_accum " << o.grad_accum << "; engine collectives, ring):\n";
  for (const TrafficItem& i : t.items) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.3f s", i.seconds);
    os << "  " << i.what << ": " << i.calls << " x " << human_bytes(i.bytes) << ", "
       << human_bytes(i.sent) << " sent per rank, " << buf << "\n";
  }
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.3f s", t.seconds);
  os << "  total: " << human_bytes(t.sent) << " sent per rank, " << buf
     << " (waited for, not overlapped)\n";
  return os.str();
}

}  // namespace lvx::planner
