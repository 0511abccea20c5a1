// mPLUG-Owl3's released files (Family::release_layout, resize_release): transformers'
// SiglipVisionModel whole (its last layer, post_layernorm and attention-pooling head too, which
// mPLUG-Owl3 never runs), the projector, Qwen2ForCausalLM (no lm_head when tied, as the 1B and 2B
// ship) and each hyper layer's v_kv_proj and gate. The 240728/241014 gated layout: config.json
// does not say which release it is, and the planner counts the gate alike (family.cpp).
#include "models/mplug_owl3/release.h"

#include "models/mplug_owl3/model.h"
#include "models/release_init.h"
#include "src/common/error.h"

namespace lvx::models::mplug_owl3 {

namespace {

// SigLIP's pooling head (SiglipMultiheadAttentionPoolingHead) and final norm.
void add_siglip_head(const SiglipConfig& v, ShapeSpec& s) {
  const std::string p = "vision_model.";
  const int64_t h = v.hidden;
  s[p + "post_layernorm.weight"] = {h};
  s[p + "post_layernorm.bias"] = {h};
  s[p + "head.probe"] = {1, 1, h};
  s[p + "head.attention.in_proj_weight"] = {3 * h, h};
  s[p + "head.attention.in_proj_bias"] = {3 * h};
  s[p + "head.attention.out_proj.weight"] = {h, h};
  s[p + "head.attention.out_proj.bias"] = {h};
  s[p + "head.layernorm.weight"] = {h};
  s[p + "head.layernorm.bias"] = {h};
  s[p + "head.mlp.fc1.weight"] = {v.mlp, h};
  s[p + "head.mlp.fc1.bias"] = {v.mlp};
  s[p + "head.mlp.fc2.weight"] = {h, v.mlp};
  s[p + "head.mlp.fc2.bias"] = {h};
}

}  // namespace

ReleaseLayout release_layout(const nlohmann::json& config, const std::string& where) {
  const MplugOwl3Config c = mplug_owl3_config(config, where, /*gated=*/true, 0);
  ReleaseLayout r;
  r.tensors = mplug_owl3_shapes(c);
  for (const auto& [name, shape] : siglip_shapes(c.vision, "vision_model.", c.vision.layers))
    r.tensors[name] = shape;  // the last layer, which hidden_states[-2] skips
  add_siglip_head(c.vision, r.tensors);
  // Qwen2's chatml tokens and mPLUG-Owl3's image token, after the vocabulary (as in Qwen2).
  for (const char* s : {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|image|>"})
    r.specials.push_back({s, -1});
  r.embedding_rows = c.vocab;
  return r;
}

nlohmann::json resize_release(const nlohmann::json& config, const ReleaseResize& r,
                              const std::string& where) {
  nlohmann::json c = config;
  if (r.layers > 0) {
    c["hyper_layers"] = layers_kept(config.value("hyper_layers", nlohmann::json::array()),
                                    r.layers, /*base=*/1, r.cross_layers, where + ": hyper_layers");
    c["num_hidden_layers"] = r.layers;
    c["max_window_layers"] = r.layers;
  }
  if (r.vision_layers > 0) {
    LVX_CHECK(r.vision_layers >= 2, where, ": vision layers ", r.vision_layers,
              ": mPLUG-Owl3 reads the next-to-last SigLIP layer, so at least 2");
    c["vision_config"]["num_hidden_layers"] = r.vision_layers;
  }
  if (r.vocab > 0) c["vocab_size"] = r.vocab;
  mplug_owl3_config(c, where, /*gated=*/true, 0);  // the result is a valid config
  return c;
}

}  // namespace lvx::models::mplug_owl3
