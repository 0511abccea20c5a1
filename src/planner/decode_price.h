// Decoding priced per token: what one new token costs at n ranks, decoded on every rank (pass-Q,
// models/decode.h: `lvx qa --decode-ranks all`) or on rank 0 alone with messages only at the
// cross layers (models/lead_decode.h: `one`, the default). A decode step at batch 1 is bound by
// the bytes it reads, so the price is those bytes at the memory's bandwidth plus the messages on
// the cluster's links:
//
//   W  the decoder's weights read per token (its layers and the head; the vision tower and the
//      embedding table are not read), K_t the prompt's text K/V (every self layer), K_v the
//      visual K/V (every cross layer, F·T keys), n ranks, l = min(n, gpus_per_node) on a node,
//      β_m the memory's bandwidth (per device, or per node where `shared`: a CPU host).
//   read, all:  each rank reads W + (K_t + K_v)/n;      shared: l·W + l·(K_t + K_v)/n on one bus
//   read, one:  rank 0 reads W + K_t + K_v/n;           shared: W + K_t + l·K_v/n
//   messages, all: per attention layer a ring all-gather of the (o, lse) partials,
//               (n−1)·(α + B·Hq·(D+1)·4/β) + sync
//   messages, one: per cross layer the query to every other rank and their partials back, posted
//               at once: 2α + (n−1)·(B·Hq·D·e + B·Hq·(D+1)·4)/β + sync
// with α, β the slowest link the ranks span (inter-node beyond one node) and sync the link's
// measured wait where ranks share cores (0 on GPUs). The prompt's one gather to rank 0 (`one`)
// is the prompt's cost, not a token's. docs/planner.md compares it with measured steps.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/common/model_config.h"
#include "src/planner/cluster_config.h"

namespace lvx::planner {

struct DecodeShape {
  int64_t frames = 0, text_tokens = 0, tokens_per_frame = 0, batch = 1;
  int64_t weight_bytes = 0;  // W: the decoder's layers and head in the run's dtype
  int64_t elem_bytes = 2;    // e: the run's dtype
};

struct DecodePrice {
  std::string way;  // "one" (rank 0 decodes) | "all" (every rank)
  int64_t ranks = 1;
  double read_s = 0;       // the bytes the step reads, at the memory's bandwidth
  double messages_s = 0;   // its messages on the links
  int64_t messages = 0;    // rank 0's per token (sends and receives)
  int64_t bytes_sent = 0;  // rank 0's per token
  double total_s() const { return read_s + messages_s; }
};

// W for a model of `layer_parameters` decoder-layer parameters and a head of `vocab` rows of the
// last layer's width, in `elem_bytes`.
int64_t decode_weight_bytes(const ModelConfig& m, int64_t layer_parameters, int64_t vocab,
                            int64_t elem_bytes);

// Whether the cluster config says how fast its memory reads (memory.bandwidth_gb_per_s).
bool can_price_decode(const ClusterConfig& c);

// One token's price at `ranks` ranks, decoded on rank 0 alone (lead) or on every rank.
DecodePrice price_decode(const ModelConfig& m, const ClusterConfig& c, const DecodeShape& s,
                         int64_t ranks, bool lead);

nlohmann::json to_json(const DecodePrice& p);
// "decode per token at n ranks: one 28.1 ms (reads 27.6, 4 cross layers' messages 0.5), all …".
std::string format_decode(const std::vector<DecodePrice>& prices);

}  // namespace lvx::planner
