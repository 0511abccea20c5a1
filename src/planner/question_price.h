// One question's time at n ranks, for `lvx qa --nproc auto` and `lvx plan`: the prefill (the
// vision tower over the frames, the language model over the prompt, the attention layers under
// the plan's strategies) plus every new token after the first at the decode price
// (decode_price.h, rank 0 decoding alone). With F frames of T visual tokens, L prompt tokens,
// G new tokens, Ψ_lm the decoder's parameters:
//   encode    F · (2·T·h_v·3p² + layers·(2·T·(4·h_v² + 2·h_v·m_v) + 4·T²·h_v)) FLOPs (patch
//             embedding, then each layer's projections, MLP and attention; the vision tower as
//             model_config.h describes it)
//   language  2·Ψ_lm·L + per cross layer 2·F·T·d_f·2·kv·D (the visual K/V projections) FLOPs
//   compute   (encode + language) ÷ rate, rate = gemm FLOP/s of one device × n (GPUs: each rank
//             its own), or of the whole host whatever n (memory.shared: the ranks split its cores,
//             so more ranks add messages, not compute)
//   attention the plan's total (planner.h) at n ranks (a shared host's, scaled by n ÷ the ranks
//             it was calibrated with: each rank then has that many more cores)
//   total     compute + attention + (G − 1) · decode(n)
// The counts are the dominant terms (no norms, softmax or embedding lookups); docs/planner.md
// puts them beside measured runs.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "src/planner/cost_model.h"
#include "src/planner/decode_price.h"

namespace lvx::planner {

struct QuestionShape {
  int64_t frames = 0, text_tokens = 0, tokens_per_frame = 0, new_tokens = 1;
  std::string dtype = "bf16";
  int64_t lm_parameters =
      0;  // Ψ_lm: the decoder's layers (the head is read, not multiplied, per token)
  int64_t weight_bytes = 0;  // W of decode_price.h
};

struct QuestionPrice {
  int64_t ranks = 1;
  double compute_s = 0, attention_s = 0;  // the prefill's parts
  double decode_s = 0;                    // per token (rank 0 alone)
  double total_s = 0;
};

// The vision tower's FLOPs for one image (as above).
double vision_flops_per_image(const ModelConfig& m);

QuestionPrice price_question(const ModelConfig& m, const ClusterConfig& c, const QuestionShape& q,
                             int64_t ranks, const CostOptions& opt = {});

// The rank count of the lowest total among `prices` (the fewest ranks on a tie).
int64_t fastest_ranks(const std::vector<QuestionPrice>& prices);

nlohmann::json to_json(const QuestionPrice& p);
// One line per rank count: "n ranks: 5.12 s (prefill compute 4.01, attention 0.10, 31 tokens × 32.9
// ms)".
std::string format_question(const std::vector<QuestionPrice>& prices, int64_t new_tokens);

}  // namespace lvx::planner
