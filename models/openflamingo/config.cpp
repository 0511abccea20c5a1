// OpenFlamingo's configuration from its converted config.json (models/openflamingo/model.h):
// every size checked and bounded before anything is sized from it.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>

#include "models/checkpoint.h"
#include "models/layers.h"
#include "models/openflamingo/model.h"
#include "src/common/error.h"

namespace lvx::models {

namespace {

std::string json_str(const nlohmann::json& j, const std::string& field,
                     const std::string& fallback) {
  return j.contains(field) && j[field].is_string() ? j[field].get<std::string>() : fallback;
}

bool json_bool(const nlohmann::json& j, const std::string& field, bool fallback) {
  return j.contains(field) && j[field].is_boolean() ? j[field].get<bool>() : fallback;
}

// vision_config: open_clip's ViT (a class token; no layer scale, no patch bias).
void read_vision_config(const nlohmann::json& v, const std::string& wv, OpenFlamingoConfig& c) {
  c.v_width = config_int_in(v, "width", wv, 1, kMaxConfigWidth);
  c.v_layers = config_int_in(v, "layers", wv, 1, kMaxConfigLayers);
  c.v_heads = config_int_in(v, "heads", wv, 1, kMaxConfigHeads);
  c.v_mlp = config_int_in(v, "mlp_width", wv, 1, kMaxConfigWidth);
  c.image_size = config_int_in(v, "image_size", wv, 1, kMaxConfigImage);
  c.patch_size = config_int_in(v, "patch_size", wv, 1, kMaxConfigImage);
  LVX_CHECK(c.v_width % c.v_heads == 0, wv, ": width ", c.v_width,
            " is not a multiple of the heads ", c.v_heads);
  // open_clip takes image_size // patch_size patches per side: at least one.
  LVX_CHECK(c.image_size >= c.patch_size, wv, ": image_size ", c.image_size, " and patch_size ",
            c.patch_size, " give no patch");
  c.v_ln_pre = json_bool(v, "ln_pre", true);
  c.v_tokens_ln_post = json_bool(v, "tokens_ln_post", true);
  c.v_act = config_string_or(v, "act", wv, "gelu");
  check_activation(c.v_act == "gelu_tanh" ? "gelu_pytorch_tanh" : c.v_act, wv + ": act");
  c.v_eps = config_positive_or(v, "norm_eps", wv, 1e-5);
  LVX_CHECK(json_bool(v, "class_token", true) && !json_bool(v, "layer_scale", false) &&
                !json_bool(v, "patch_embed_bias", false),
            wv, ": only class-token ViTs without layer scale or patch bias are supported");
}

// perceiver_config: the resampler, its feed-forward a multiple of the vision width; no media or
// frame time embeddings.
void read_perceiver_config(const nlohmann::json& p, const std::string& wp, OpenFlamingoConfig& c) {
  c.p_depth = config_int_in(p, "depth", wp, 1, kMaxConfigLayers);
  c.p_heads = config_int_in(p, "heads", wp, 1, kMaxConfigHeads);
  c.p_dim_head = config_int_in(p, "dim_head", wp, 1, kMaxConfigWidth);
  c.p_latents = config_int_in(p, "num_latents", wp, 1, 1 << 16);
  c.p_ff = config_int_in(p, "ff_mult", wp, 1, 64) * c.v_width;
  c.p_eps = config_positive_or(p, "norm_eps", wp, 1e-5);
  LVX_CHECK(p.value("max_num_media", nlohmann::json()).is_null() &&
                p.value("max_num_frames", nlohmann::json()).is_null(),
            wp, ": media/frame time embeddings are not supported");
}

// cross_attn_config: the gated cross-attention blocks, which attend to the immediate media only.
void read_cross_attn_config(const nlohmann::json& x, const std::string& wx, OpenFlamingoConfig& c) {
  c.x_heads = config_int_in(x, "heads", wx, 1, kMaxConfigHeads);
  c.x_dim_head = config_int_in(x, "dim_head", wx, 1, kMaxConfigWidth);
  c.x_eps = config_positive_or(x, "norm_eps", wx, 1e-5);
  LVX_CHECK(json_bool(x, "only_attend_immediate_media", true), wx,
            ": only_attend_immediate_media false is not supported (the released models use true)");
}

// text_config of a gpt_neox decoder: its sizes, its partial rotary embedding (under either of
// transformers' names), LayerNorm, activation and biases.
void read_gpt_neox_config(const nlohmann::json& t, const std::string& where, const std::string& wt,
                          OpenFlamingoConfig& c) {
  LVX_CHECK(c.layers_attr == "gpt_neox.layers", where, ": decoder_layers_attr: expected ",
            "\"gpt_neox.layers\" for gpt_neox, got \"", c.layers_attr, "\"");
  c.hidden = config_int_in(t, "hidden_size", wt, 1, kMaxConfigWidth);
  c.layers = config_int_in(t, "num_hidden_layers", wt, 1, kMaxConfigLayers);
  c.heads = config_int_in(t, "num_attention_heads", wt, 1, kMaxConfigHeads);
  c.mlp = config_int_in(t, "intermediate_size", wt, 1, kMaxConfigWidth);
  LVX_CHECK(c.hidden % c.heads == 0, wt, ": hidden size ", c.hidden,
            " is not a multiple of the heads ", c.heads);
  // transformers' older and newer names for one field; a null one does not count.
  auto given = [&](const char* f) { return t.contains(f) && !t[f].is_null(); };
  const std::string pct_field = given("rotary_pct") ? "rotary_pct" : "partial_rotary_factor";
  const double pct = config_positive_or(t, pct_field, wt, 1.0);
  LVX_CHECK(pct <= 1.0, wt, ": ", pct_field, ": expected a fraction in (0, 1], got ", pct);
  c.rotary_dim = static_cast<int64_t>(static_cast<double>(c.hidden / c.heads) * pct);
  LVX_CHECK(c.rotary_dim >= 2 && c.rotary_dim % 2 == 0, wt, ": ", pct_field, " ", pct,
            " of head size ", c.hidden / c.heads, " gives ", c.rotary_dim,
            " rotary channels (must be even and at least 2)");
  c.rotary_base =
      config_positive_or(t, given("rotary_emb_base") ? "rotary_emb_base" : "rope_theta", wt, 10000);
  c.eps = config_positive_or(t, "layer_norm_eps", wt, 1e-5);
  c.parallel_residual = json_bool(t, "use_parallel_residual", true);
  c.act = config_string_or(t, "hidden_act", wt, "gelu");
  check_activation(c.act, wt + ": hidden_act");
  c.lm_biases = true;
}

// text_config of an mpt decoder: its sizes, ALiBi (the only attention option supported), no
// biases, tied embeddings.
void read_mpt_config(const nlohmann::json& t, const std::string& where, const std::string& wt,
                     OpenFlamingoConfig& c) {
  LVX_CHECK(c.layers_attr == "transformer.blocks", where, ": decoder_layers_attr: expected ",
            "\"transformer.blocks\" for mpt, got \"", c.layers_attr, "\"");
  c.hidden = config_int_in(t, "d_model", wt, 1, kMaxConfigWidth);
  c.layers = config_int_in(t, "n_layers", wt, 1, kMaxConfigLayers);
  c.heads = config_int_in(t, "n_heads", wt, 1, kMaxConfigHeads);
  LVX_CHECK(c.hidden % c.heads == 0, wt, ": hidden size ", c.hidden,
            " is not a multiple of the heads ", c.heads);
  c.mlp = 4 * c.hidden;  // transformers' MPT: a 4·d MLP whatever expansion_ratio says
  c.eps = config_positive_or(t, "layer_norm_epsilon", wt, 1e-5);
  const nlohmann::json a = t.value("attn_config", nlohmann::json::object());
  LVX_CHECK(a.is_object(), wt, ": attn_config: expected an object, got ", a.dump());
  LVX_CHECK(json_bool(a, "alibi", true), wt, ": attn_config.alibi false is not supported");
  LVX_CHECK(!json_bool(a, "qk_ln", false), wt, ": attn_config.qk_ln (QK LayerNorm, MosaicGPT ",
            "mpt-1b) is not supported yet");
  LVX_CHECK(a.value("clip_qkv", nlohmann::json()).is_null(), wt,
            ": attn_config.clip_qkv is not supported");
  LVX_CHECK(a.value("softmax_scale", nlohmann::json()).is_null(), wt,
            ": attn_config.softmax_scale is not supported");
  c.alibi_bias_max = config_positive_or(a, "alibi_bias_max", wt + ": attn_config", 8);
  c.lm_biases = false;
  c.tied = true;
}

// text_config of a llama decoder: its sizes, rotary base, RMSNorm, activation; no rope scaling,
// no biases.
void read_llama_config(const nlohmann::json& t, const std::string& where, const std::string& wt,
                       OpenFlamingoConfig& c) {
  LVX_CHECK(c.layers_attr == "model.layers", where, ": decoder_layers_attr: expected ",
            "\"model.layers\" for llama, got \"", c.layers_attr, "\"");
  c.hidden = config_int_in(t, "hidden_size", wt, 1, kMaxConfigWidth);
  c.layers = config_int_in(t, "num_hidden_layers", wt, 1, kMaxConfigLayers);
  c.heads = config_int_in(t, "num_attention_heads", wt, 1, kMaxConfigHeads);
  c.mlp = config_int_in(t, "intermediate_size", wt, 1, kMaxConfigWidth);
  c.rotary_base = config_positive_or(t, "rope_theta", wt, 10000);
  c.eps = config_positive_or(t, "rms_norm_eps", wt, 1e-6);
  c.act = config_string_or(t, "hidden_act", wt, "silu");
  check_activation(c.act, wt + ": hidden_act");
  LVX_CHECK(t.value("rope_scaling", nlohmann::json()).is_null(), wt,
            ": rope_scaling is not supported");
  LVX_CHECK(!json_bool(t, "attention_bias", false) && !json_bool(t, "mlp_bias", false), wt,
            ": attention_bias / mlp_bias are not supported");
  LVX_CHECK((t.contains("head_dim") && !t["head_dim"].is_null()) || c.hidden % c.heads == 0, wt,
            ": hidden size ", c.hidden, " is not a multiple of the heads ", c.heads,
            " (and head_dim is not given)");
  c.lm_biases = false;
}

// transformers' defaults for what a text_config leaves out. The cross blocks' feed-forward is 4
// times the hidden size.
void read_text_defaults(const nlohmann::json& t, const std::string& wt, OpenFlamingoConfig& c) {
  c.kv_heads = c.lm == "llama"
                   ? config_int_in_or(t, "num_key_value_heads", wt, 1, kMaxConfigHeads, c.heads)
                   : c.heads;
  LVX_CHECK(c.heads % c.kv_heads == 0, wt, ": num_attention_heads (", c.heads,
            ") must be a multiple of num_key_value_heads (", c.kv_heads, ")");
  c.head_dim = c.lm == "llama"
                   ? config_int_in_or(t, "head_dim", wt, 1, kMaxConfigWidth, c.hidden / c.heads)
                   : c.hidden / c.heads;
  if (c.lm == "llama") {
    c.rotary_dim = c.head_dim;
    LVX_CHECK(c.head_dim % 2 == 0, wt, ": head_dim ", c.head_dim,
              " must be even (rotary embeddings rotate channel pairs)");
  }
  c.x_ff = 4 * c.hidden;
}

// cross_attn_layers: the 0-based decoder layers with a gated cross block, each a layer of the
// decoder.
void read_cross_layers(const nlohmann::json& j, const std::string& where, OpenFlamingoConfig& c) {
  LVX_CHECK(j.contains("cross_attn_layers") && j["cross_attn_layers"].is_array(), where,
            ": cross_attn_layers: missing (the 0-based decoder layers with a gated cross block)");
  for (const auto& l : j["cross_attn_layers"]) {
    LVX_CHECK(l.is_number_integer() && l.get<int64_t>() >= 0 && l.get<int64_t>() < c.layers, where,
              ": cross_attn_layers: expected 0-based layer indices in [0, ", c.layers, "), got ",
              l.dump());
    c.cross_layers.push_back(l.get<int64_t>());
  }
}

}  // namespace

bool OpenFlamingoConfig::is_cross(int64_t layer) const {
  return std::find(cross_layers.begin(), cross_layers.end(), layer) != cross_layers.end();
}

// The sections in turn (the text_config by its decoder kind), then the defaults that depend on
// them and the cross-attention layers; `where` (the file) starts every message.
OpenFlamingoConfig openflamingo_config(const nlohmann::json& j, const std::string& where) {
  const std::string type = json_str(j, "model_type", "");
  LVX_CHECK(type == "openflamingo", where, ": model_type: expected \"openflamingo\", got \"", type,
            "\"");
  for (const char* f : {"vision_config", "perceiver_config", "cross_attn_config", "text_config"})
    LVX_CHECK(j.contains(f) && j[f].is_object(), where, ": ", f, ": missing (write the directory ",
              "with models/openflamingo/convert_openflamingo.py)");
  OpenFlamingoConfig c;
  const auto &v = j["vision_config"], &p = j["perceiver_config"], &x = j["cross_attn_config"],
             &t = j["text_config"];
  const std::string wv = where + ": vision_config", wp = where + ": perceiver_config",
                    wx = where + ": cross_attn_config", wt = where + ": text_config";
  // Every size positive and bounded, and checked before any division by it.
  read_vision_config(v, wv, c);
  read_perceiver_config(p, wp, c);
  read_cross_attn_config(x, wx, c);
  c.layers_attr = json_str(j, "decoder_layers_attr", "");
  c.vocab = config_int_in(j, "vocab_size", where, 1, kMaxConfigVocab);
  c.media_token_id = config_int_in(j, "media_token_id", where, 0, c.vocab - 1);
  c.tied = json_bool(j, "tie_word_embeddings", false);
  c.lm = json_str(t, "model_type", "");
  if (c.lm == "gpt_neox") {
    read_gpt_neox_config(t, where, wt, c);
  } else if (c.lm == "mpt") {
    read_mpt_config(t, where, wt, c);
  } else if (c.lm == "llama") {
    read_llama_config(t, where, wt, c);
  } else {
    LVX_FAIL(wt, ": model_type '", c.lm, "' is not supported (gpt_neox, mpt, llama)");
  }
  read_text_defaults(t, wt, c);
  read_cross_layers(j, where, c);
  return c;
}

}  // namespace lvx::models
