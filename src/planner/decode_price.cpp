#include "src/planner/decode_price.h"

#include <algorithm>
#include <iomanip>
#include <sstream>

#include "src/common/error.h"

namespace lvx::planner {

namespace {

// The K/V bytes of the layers of `kind` over `keys` keys per sample.
double kv_bytes(const ModelConfig& m, LayerKind kind, int64_t keys, const DecodeShape& s) {
  double bytes = 0;
  for (const AttentionLayerConfig& l : m.layers)
    if (l.kind == kind)
      bytes += 2.0 * double(s.batch) * double(keys) * double(l.kv_heads) * double(l.head_dim) *
               double(s.elem_bytes);
  return bytes;
}

// The slowest link `ranks` ranks span.
const Link& slowest_link(const ClusterConfig& c, int64_t ranks) {
  return ranks > c.gpus_per_node ? c.inter_node : c.intra_node;
}

double comm(const Link& l, double bytes) {
  return bytes > 0 ? l.latency_s + bytes / l.bandwidth_bytes_per_s : 0;
}

// A partial (o, then lse) of one query row per sample: B·Hq·(D+1) fp32 values.
double partial_bytes(const AttentionLayerConfig& l, int64_t batch) {
  return double(batch) * double(l.heads) * double(l.head_dim + 1) * 4;
}

}  // namespace

int64_t decode_weight_bytes(const ModelConfig& m, int64_t layer_parameters, int64_t vocab,
                            int64_t elem_bytes) {
  const int64_t width = m.layers.empty() ? 0 : m.layers.back().hidden_size;
  return (layer_parameters + vocab * width) * elem_bytes;
}

bool can_price_decode(const ClusterConfig& c) { return c.memory.bandwidth_bytes_per_s > 0; }

DecodePrice price_decode(const ModelConfig& m, const ClusterConfig& c, const DecodeShape& s,
                         int64_t ranks, bool lead) {
  LVX_CHECK(can_price_decode(c), "cluster '", c.name,
            "': no memory bandwidth (memory.bandwidth_gb_per_s) to price decoding with");
  LVX_CHECK(ranks >= 1, "decode price: ranks must be >= 1, got ", ranks);
  DecodePrice p;
  p.way = lead ? "one" : "all";
  p.ranks = ranks;
  const double n = double(ranks);
  const double local = double(std::min<int64_t>(ranks, std::max<int64_t>(1, c.gpus_per_node)));
  const double W = double(s.weight_bytes);
  const double kt = kv_bytes(m, LayerKind::kSelf, s.text_tokens, s);
  const double kv = kv_bytes(m, LayerKind::kCross, s.frames * s.tokens_per_frame, s);
  const bool shared = c.memory.shared;
  const double read = lead ? (shared ? W + kt + local * kv / n : W + kt + kv / n)
                           : (shared ? local * W + local * (kt + kv) / n : W + (kt + kv) / n);
  p.read_s = read / c.memory.bandwidth_bytes_per_s;
  if (ranks == 1) return p;
  const Link& link = slowest_link(c, ranks);
  for (const AttentionLayerConfig& l : m.layers) {
    const double part = partial_bytes(l, s.batch);
    if (!lead) {  // every attention: a ring all-gather of n partials
      p.messages_s += (n - 1) * comm(link, part) + link.sync_s;
      p.messages += 2 * (ranks - 1);
      p.bytes_sent += static_cast<int64_t>((n - 1) * part);
      continue;
    }
    if (l.kind != LayerKind::kCross) continue;
    const double query =
        double(s.batch) * double(l.heads) * double(l.head_dim) * double(s.elem_bytes);
    p.messages_s +=
        2 * link.latency_s + (n - 1) * (query + part) / link.bandwidth_bytes_per_s + link.sync_s;
    p.messages += 2 * (ranks - 1);
    p.bytes_sent += static_cast<int64_t>((n - 1) * query);
  }
  return p;
}

nlohmann::json to_json(const DecodePrice& p) {
  return {{"way", p.way},
          {"ranks", p.ranks},
          {"seconds", p.total_s()},
          {"read_s", p.read_s},
          {"messages_s", p.messages_s},
          {"messages", p.messages},
          {"bytes_sent", p.bytes_sent}};
}

std::string format_decode(const std::vector<DecodePrice>& prices) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2);
  os << "decode per token (rank 0; --decode-ranks):\n";
  for (const DecodePrice& p : prices)
    os << "  " << p.ranks << " rank" << (p.ranks == 1 ? " " : "s") << " " << p.way << ": "
       << p.total_s() * 1e3 << " ms (memory reads " << p.read_s * 1e3 << " ms, " << p.messages
       << " messages " << p.messages_s * 1e3 << " ms, " << p.bytes_sent << " bytes sent)\n";
  return os.str();
}

}  // namespace lvx::planner
