// The description of a cross-attention MLLM that the planner prices and the models report
// (`Model::planner_model()`): its attention layers in execution order with their shapes, its
// vision encoder and visual tokens. Plain data below both the planner and the models, so that
// neither layer depends on the other for it; the planner reads it from configs/models/*.yaml
// (src/planner/model_yaml.h), the models build it from a checkpoint's config. Field reference:
// docs/planner.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lvx {

enum class LayerKind { kSelf, kCross };
const char* to_string(LayerKind kind);

// Which keys a query sees (the families of kernels/mask.h).
enum class MaskRule {
  kNone,            // dense
  kCausal,          // self-attention over text
  kMediaImmediate,  // a text token sees only its most recent frame
  kMediaUpTo,       // a text token sees every earlier frame
};
const char* to_string(MaskRule rule);
MaskRule mask_rule_from_string(const std::string& s, const std::string& where);

// Bytes per element of an activation dtype name: bf16, fp16 → 2, fp32 → 4.
int64_t dtype_bytes(const std::string& dtype, const std::string& where);

// One attention layer (one LM block has one self layer; a hyper/gated block adds a cross layer).
struct AttentionLayerConfig {
  LayerKind kind = LayerKind::kSelf;
  int64_t hidden_size = 0;  // width of the residual stream the layer reads (queries' input)
  int64_t heads = 0;        // query heads Hq
  int64_t kv_heads = 0;     // key/value heads Hkv (GQA when < heads); heads % kv_heads == 0
  int64_t head_dim = 0;     // D
  int64_t mlp_size = 0;     // MLP width of the block (not used by the attention cost model)
  MaskRule mask = MaskRule::kCausal;
};

struct VisionEncoderConfig {
  int64_t hidden_size = 0, layers = 0, heads = 0, mlp_size = 0, image_size = 0, patch_size = 0;
};

struct ModelConfig {
  std::string name;
  std::string family;  // the YAML's or the checkpoint family's own label (data, not a switch)
  std::string dtype;   // activation dtype: bf16 | fp16 | fp32
  int64_t visual_tokens_per_frame = 0;
  int64_t visual_feature_dim = 0;  // width of the visual features y that cross layers project
  VisionEncoderConfig vision;
  int64_t vocab_size = 0;  // optional (`vocab_size`): embedding and output rows, for memory plans
  // optional (`config_json`): the release's config.json (a path beside the YAML), from which the
  // parameter counts are exact (the family's own shapes) instead of estimated from the layers
  std::string config_json;
  std::vector<AttentionLayerConfig> layers;  // expanded (a `repeat: n` entry becomes n layers)
  int64_t count(LayerKind kind) const;
};

}  // namespace lvx
