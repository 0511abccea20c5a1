// The fine-tuning MFU's model FLOPs (src/planner/train_flops.h) against a count of every matrix
// product of a small Qwen2-style decoder with one cross layer and a ViT, written out one product at
// a time (2·M·N·K each): the formula's shortcut through the parameter count (2·Ψ·L) and its
// attention terms must give the same number, and training multiplies the parts as documented.
#include <gtest/gtest.h>

#include "src/planner/question_price.h"
#include "src/planner/train_flops.h"

using namespace lvx;

namespace {

double mm(double m, double n, double k) { return 2 * m * n * k; }

}  // namespace

TEST(TrainFlops, EqualsEveryMatrixProductCountedOneByOne) {
  const int64_t h = 64, hq = 4, hkv = 2, d = 16, mlp = 128, vocab = 1000, layers = 3;
  const int64_t frames = 5, tpf = 9, text = 40, feat = 48;
  ModelConfig m;
  m.visual_tokens_per_frame = tpf;
  m.visual_feature_dim = feat;
  m.vision = {/*hidden*/ 32, /*layers*/ 2, /*heads*/ 2,
              /*mlp*/ 64,    /*image*/ 24, /*patch*/ 8};
  for (int64_t i = 0; i < layers; ++i)
    m.layers.push_back({LayerKind::kSelf, h, hq, hkv, d, mlp, MaskRule::kCausal});
  m.layers.push_back({LayerKind::kCross, h, hq, hkv, d, mlp, MaskRule::kCausal});
  // Ψ_lm: the decoder layers' weights (q, k, v, o, gate, up, down) of the 3 self layers.
  const int64_t per_layer = h * hq * d + 2 * h * hkv * d + hq * d * h + 3 * h * mlp;
  planner::SampleShape s;
  s.frames = frames;
  s.tokens_per_frame = tpf;
  s.text_tokens = text;
  s.lm_parameters = layers * per_layer;
  s.vocab = vocab;
  s.hidden = h;
  const planner::TrainFlops f = planner::train_flops(m, s);

  const double L = text, S = frames * tpf;
  double language = 0, attention = 0;
  for (int64_t i = 0; i < layers; ++i) {
    language += mm(L, hq * d, h) + 2 * mm(L, hkv * d, h) + mm(L, h, hq * d);  // q, k, v, o
    language += 2 * mm(L, mlp, h) + mm(L, h, mlp);                            // gate, up, down
    attention += (mm(L, L, d) + mm(L, d, L)) * hq / 2;  // QKᵀ and PV, causal: half the pairs
  }
  language += 2 * mm(S, hkv * d, feat);           // the cross layer's visual K and V
  attention += (mm(L, S, d) + mm(L, d, S)) * hq;  // every text token against every key
  language += mm(L, vocab, h);                    // logits
  const double T = (24 / 8) * (24 / 8), vh = 32, vm = 64;
  double vision = mm(T, vh, 3 * 8 * 8);  // patch embedding
  for (int i = 0; i < 2; ++i)
    vision += 4 * mm(T, vh, vh) + mm(T, vm, vh) + mm(T, vh, vm) + mm(T, T, vh) + mm(T, vh, T);
  vision *= frames;

  EXPECT_DOUBLE_EQ(f.language, language);
  EXPECT_DOUBLE_EQ(f.attention, attention);
  EXPECT_DOUBLE_EQ(f.vision, vision);
  EXPECT_DOUBLE_EQ(f.vision, frames * planner::vision_flops_per_image(m));
  EXPECT_DOUBLE_EQ(f.training, 3 * (language + attention) + vision);  // frozen vision: forward
  s.lora = true;
  EXPECT_DOUBLE_EQ(planner::train_flops(m, s).training, 2 * (language + attention) + vision);
  s.lora = false;
  s.vision_trains = true;
  EXPECT_DOUBLE_EQ(planner::train_flops(m, s).training, 3 * (language + attention + vision));
}
