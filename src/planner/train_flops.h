// The model FLOPs of one fine-tuning sample, for the MFU that lvx finetune logs at every step
// (docs/finetune.md has the formula beside this one). With F frames (images) of T visual tokens,
// L text tokens, Ψ_lm the decoder layers' parameters and V × h the output head:
//   vision     F · vision_flops_per_image (question_price.h: patch embedding, each layer's
//              projections, MLP and attention)
//   language   2·Ψ_lm·L + 2·V·h·L (the head's logits) + per cross layer 2·F·T·d_f·2·Hkv·D (the
//              visual K/V projections)
//   attention  per self layer 4·L²·Hq·D · ½ (causal), per cross layer 4·L·F·T·Hq·D (every text
//              token against every visual key: the masks' skipped blocks are counted, as the
//              usual convention counts causal attention at half)
//   training   3 × (language + attention) (forward, the input's and the weights' gradients), or 2 ×
//              under LoRA (the frozen weights get no gradient; the adapters' own FLOPs are
//              negligible), plus the vision tower once when frozen (forward only) or 3 × when it
//              trains (freeze.policy none)
// The counts are the dominant terms (no norms, softmax, embedding lookups or optimizer): MFU =
// these FLOPs ÷ step time ÷ the devices' peak, the usual definition (PaLM's), which counts
// recomputation (remat, parallel.recompute) as not done.
#pragma once

#include <cstdint>

#include "src/common/model_config.h"

namespace lvx::planner {

struct SampleShape {
  int64_t frames = 0, tokens_per_frame = 0, text_tokens = 0;
  int64_t lm_parameters = 0;      // Ψ_lm: every parameter of the decoder layers
  int64_t vocab = 0, hidden = 0;  // the output head V × h (0: not counted)
  bool vision_trains = false;     // freeze.policy none
  bool lora = false;              // the language model's weights are frozen
};

struct TrainFlops {
  double vision = 0, language = 0, attention = 0;  // forward FLOPs of each part
  double training = 0;                             // the sample's whole step (as above)
};

TrainFlops train_flops(const ModelConfig& m, const SampleShape& s);

}  // namespace lvx::planner
