#include "src/planner/model_yaml.h"

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/planner/yaml_fields.h"

namespace lvx::planner {

ModelConfig load_model_config(const std::string& path) {
  YamlMap root = load_yaml_map(path);
  ModelConfig m;
  m.name = root.get_string("name");
  m.family = root.get_string("family");
  m.dtype = root.get_string("dtype");
  dtype_bytes(m.dtype, root.where("dtype"));
  m.visual_tokens_per_frame = root.get_int("visual_tokens_per_frame");
  m.visual_feature_dim = root.get_int("visual_feature_dim");
  m.vocab_size = root.get_int_or("vocab_size", 0);
  m.config_json = root.get_string_or("config_json", "");
  if (!m.config_json.empty() && m.config_json.front() != '/') {
    const size_t slash = path.rfind('/');
    m.config_json = (slash == std::string::npos ? "" : path.substr(0, slash + 1)) + m.config_json;
  }
  YamlMap v = root.get_map("vision_encoder");
  m.vision.hidden_size = v.get_int("hidden_size");
  m.vision.layers = v.get_int("layers");
  m.vision.heads = v.get_int("heads");
  m.vision.mlp_size = v.get_int("mlp_size");
  m.vision.image_size = v.get_int("image_size");
  m.vision.patch_size = v.get_int("patch_size");
  v.finish();
  for (const YamlMap& e : root.get_map_list("layers")) {
    AttentionLayerConfig l;
    std::string kind = e.get_string("kind");
    if (kind == "self") {
      l.kind = LayerKind::kSelf;
    } else if (kind == "cross") {
      l.kind = LayerKind::kCross;
    } else {
      LVX_FAIL(e.where("kind"), ": expected self|cross, got '", kind, "'");
    }
    l.hidden_size = e.get_int("hidden_size");
    l.heads = e.get_int("heads");
    l.kv_heads = e.get_int("kv_heads");
    l.head_dim = e.get_int("head_dim");
    l.mlp_size = e.get_int("mlp_size");
    l.mask = mask_rule_from_string(e.get_string("mask"), e.where("mask"));
    int64_t repeat = e.get_int_or("repeat", 1);
    e.finish();
    LVX_CHECK(l.heads % l.kv_heads == 0, e.where("kv_heads"), ": heads (", l.heads,
              ") must be a multiple of kv_heads (", l.kv_heads, ")");
    bool cross_mask = l.mask == MaskRule::kMediaImmediate || l.mask == MaskRule::kMediaUpTo;
    LVX_CHECK(l.kind == LayerKind::kCross || !cross_mask, e.where("mask"),
              ": a self-attention layer cannot use a media mask");
    LVX_CHECK(l.kind == LayerKind::kSelf || l.mask != MaskRule::kCausal, e.where("mask"),
              ": a cross-attention layer cannot be causal");
    for (int64_t i = 0; i < repeat; ++i) m.layers.push_back(l);
  }
  root.finish();
  return m;
}

}  // namespace lvx::planner
