// One fine-tuning sample's model FLOPs; see train_flops.h.
#include "src/planner/train_flops.h"

#include "src/planner/question_price.h"

namespace lvx::planner {

TrainFlops train_flops(const ModelConfig& m, const SampleShape& s) {
  TrainFlops f;
  const double L = double(s.text_tokens);
  const double visual = double(s.frames) * double(s.tokens_per_frame);
  f.vision = double(s.frames) * vision_flops_per_image(m);
  f.language = 2 * double(s.lm_parameters) * L + 2 * double(s.vocab) * double(s.hidden) * L;
  for (const AttentionLayerConfig& l : m.layers) {
    const double qd = double(l.heads) * double(l.head_dim);
    if (l.kind == LayerKind::kCross) {
      f.language += 2 * visual * double(m.visual_feature_dim) * 2 * double(l.kv_heads * l.head_dim);
      f.attention += 4 * L * visual * qd;
    } else {
      f.attention += 4 * L * L * qd / 2;
    }
  }
  f.training = (s.lora ? 2 : 3) * (f.language + f.attention) + (s.vision_trains ? 3 : 1) * f.vision;
  return f;
}

}  // namespace lvx::planner
