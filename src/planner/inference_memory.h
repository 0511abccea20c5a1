// The memory of one rank answering a question (lvx qa, one lvx serve request): the weights, the
// visual features and the vision tower's transient while it encodes them, the KV cache, the
// prefill's largest transient and the logits. Pure arithmetic over parameter counts and shapes,
// the inference counterpart of train_memory.h; docs/real_size.md compares it with measured peaks.
//
// With e bytes per element (the run's dtype), Ψ the parameters the model holds, n ranks, F frames
// of T visual tokens (each rank encodes and keeps F·T/n of them), L prompt tokens (each rank
// holds L/n of them in the text layout) and G generated tokens (replicated on every rank):
//   weights     e·Ψ on every rank (local ranks that run the checkpoint's own dtype share these
//               pages: one copy per host, but each rank's resident set counts them)
//   visual      F·T/n·(d_f + 3·h_v + 2·m_v)·e: the features the cross layers read (width d_f)
//               and the tower's largest transient while it encodes them in one batch (its
//               residual, a norm's output and the attention output of width h_v, the MLP's
//               intermediate and activation of width m_v)
//   kv cache    per self-attention layer (L/n + G)·2·kv·e, per cross layer F·T/n·2·kv·e
//   activations the largest decoder layer's transient over the L/n prompt tokens:
//               (3h + 2m + q + 2kv)·e a token (residual, norm, MLP intermediate and activation,
//               the queries, keys and values)
//   logits      the last token's over the vocabulary V in fp32, and its softmax: 8·V
// peak = weights + visual + kv cache + activations + logits (the process's own libraries come on
// top: an lvx rank that has loaded nothing holds ~150-300 MB).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "src/planner/train_memory.h"

namespace lvx::planner {

struct InferenceMemory {
  double weights = 0, visual = 0, kv_cache = 0, activations = 0, logits = 0;
  double total = 0;  // the peak, as above
};

InferenceMemory inference_memory(const ModelConfig& m, const ParamCounts& params, int64_t frames,
                                 int64_t text_tokens, int64_t tokens_per_frame,
                                 int64_t new_tokens, int64_t ranks, int64_t elem_bytes);

nlohmann::json to_json(const InferenceMemory& t);
std::string format_memory(const InferenceMemory& t);

}  // namespace lvx::planner
