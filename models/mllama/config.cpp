#include "models/mllama/config.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "models/layers.h"
#include "src/common/error.h"

namespace lvx::models::mllama {

namespace {

const std::string kLm = "language_model.model.";
const std::string kVision = "vision_model.";

// A list of distinct integers in [lo, hi] (required).
std::vector<int64_t> int_list(const nlohmann::json& j, const std::string& field,
                              const std::string& where, int64_t lo, int64_t hi) {
  LVX_CHECK(j.contains(field) && j[field].is_array(), where, ": ", field,
            ": expected a list of integers in [", lo, ", ", hi, "]");
  LVX_CHECK(j[field].size() <= static_cast<size_t>(kMaxConfigLayers), where, ": ", field, ": ",
            j[field].size(), " entries, at most ", kMaxConfigLayers);
  std::vector<int64_t> out;
  std::set<int64_t> seen;
  for (const auto& v : j[field]) {
    LVX_CHECK(v.is_number_integer() && v.get<int64_t>() >= lo && v.get<int64_t>() <= hi, where,
              ": ", field, ": expected integers in [", lo, ", ", hi, "], got ", v.dump());
    LVX_CHECK(seen.insert(v.get<int64_t>()).second, where, ": ", field, ": ", v.dump(),
              " is listed twice");
    out.push_back(v.get<int64_t>());
  }
  return out;
}

const nlohmann::json& sub_object(const nlohmann::json& j, const std::string& field,
                                 const std::string& where) {
  LVX_CHECK(j.contains(field) && j[field].is_object(), where, ": ", field,
            ": missing (expected an object)");
  return j[field];
}

TextConfig text_config(const nlohmann::json& j, const std::string& where) {
  TextConfig c;
  c.hidden = config_int_in(j, "hidden_size", where, 1, kMaxConfigWidth);
  c.layers = config_int_in(j, "num_hidden_layers", where, 1, kMaxConfigLayers);
  c.heads = config_int_in(j, "num_attention_heads", where, 1, kMaxConfigHeads);
  c.kv_heads = config_int_in_or(j, "num_key_value_heads", where, 1, kMaxConfigHeads, c.heads);
  // transformers' Mllama text attention: head_dim = hidden_size // num_attention_heads.
  LVX_CHECK(c.hidden % c.heads == 0, where, ": hidden_size (", c.hidden,
            ") must be a multiple of num_attention_heads (", c.heads, ")");
  c.head_dim = c.hidden / c.heads;
  LVX_CHECK(c.heads % c.kv_heads == 0, where, ": num_attention_heads (", c.heads,
            ") must be a multiple of num_key_value_heads (", c.kv_heads, ")");
  LVX_CHECK(c.head_dim % 2 == 0, where,
            ": head_dim (hidden_size / num_attention_heads = ", c.head_dim,
            ") must be even (rotary embeddings rotate channel pairs)");
  c.intermediate = config_int_in(j, "intermediate_size", where, 1, kMaxConfigWidth);
  c.vocab = config_int_in(j, "vocab_size", where, 1, kMaxConfigVocab);
  c.rope_theta = config_positive_or(j, "rope_theta", where, 5e5);
  c.rms_eps = config_positive_or(j, "rms_norm_eps", where, 1e-5);
  c.act = config_string_or(j, "hidden_act", where, "silu");
  check_activation(c.act, where + ": hidden_act");
  LVX_CHECK(!j.contains("tie_word_embeddings") || j["tie_word_embeddings"].is_boolean(), where,
            ": tie_word_embeddings: expected true or false, got ", j["tie_word_embeddings"].dump());
  c.tie_embeddings = j.value("tie_word_embeddings", false);
  c.cross_layers = int_list(j, "cross_attention_layers", where + ": text_config", 0, c.layers - 1);
  std::sort(c.cross_layers.begin(), c.cross_layers.end());
  const nlohmann::json rs = j.value("rope_scaling", nlohmann::json());
  if (!rs.is_null()) {
    LVX_CHECK(rs.is_object(), where, ": rope_scaling: expected an object or null, got ", rs.dump());
    const std::string type = rs.contains("rope_type") ? config_string_or(rs, "rope_type", where, "")
                                                      : config_string_or(rs, "type", where, "");
    const std::string at = where + ": rope_scaling";
    LVX_CHECK(type == "llama3" || type == "default", at,
              ".rope_type: expected \"llama3\" or \"default\", got \"", type, "\"");
    c.rope_type = type;
    if (type == "llama3") {
      c.rope_factor = config_positive_or(rs, "factor", at, 0);
      LVX_CHECK(c.rope_factor > 0 && c.rope_factor <= 1e6, at,
                ".factor: expected in (0, 1e6], got ", c.rope_factor);
      c.low_freq_factor = config_positive_or(rs, "low_freq_factor", at, 1);
      c.high_freq_factor = config_positive_or(rs, "high_freq_factor", at, 4);
      LVX_CHECK(c.high_freq_factor > c.low_freq_factor, at, ": high_freq_factor (",
                c.high_freq_factor, ") must exceed low_freq_factor (", c.low_freq_factor, ")");
      c.original_max_positions =
          config_int_in(rs, "original_max_position_embeddings", at, 1, int64_t{1} << 40);
    }
  }
  return c;
}

VisionConfig vision_config(const nlohmann::json& j, const std::string& where) {
  VisionConfig c;
  c.hidden = config_int_in_or(j, "hidden_size", where, 1, kMaxConfigWidth, 1280);
  c.layers = config_int_in_or(j, "num_hidden_layers", where, 1, kMaxConfigLayers, 32);
  c.global_layers = config_int_in_or(j, "num_global_layers", where, 0, kMaxConfigLayers, 8);
  // config.json writes attention_heads (MllamaVisionConfig's attribute); the constructor's
  // keyword is num_attention_heads.
  c.heads = j.contains("attention_heads")
                ? config_int_in(j, "attention_heads", where, 1, kMaxConfigHeads)
                : config_int_in_or(j, "num_attention_heads", where, 1, kMaxConfigHeads, 16);
  LVX_CHECK(c.hidden % c.heads == 0, where, ": hidden_size (", c.hidden,
            ") must be a multiple of attention_heads (", c.heads, ")");
  c.intermediate = config_int_in_or(j, "intermediate_size", where, 1, kMaxConfigWidth, 5120);
  c.image_size = config_int_in_or(j, "image_size", where, 1, kMaxConfigImage, 448);
  c.patch_size = config_int_in_or(j, "patch_size", where, 1, kMaxConfigImage, 14);
  LVX_CHECK(c.patch_size <= c.image_size, where, ": patch_size (", c.patch_size,
            ") exceeds image_size (", c.image_size, ")");
  c.max_num_tiles = config_int_in_or(j, "max_num_tiles", where, 1, 64, 4);
  c.norm_eps = config_positive_or(j, "norm_eps", where, 1e-5);
  const std::string act = config_string_or(j, "hidden_act", where, "gelu");
  LVX_CHECK(act == "gelu", where, ": hidden_act: expected \"gelu\" (every release), got \"", act,
            "\"");
  LVX_CHECK(config_int_or(j, "num_channels", 3) == 3, where, ": num_channels: expected 3, got ",
            j["num_channels"].dump());
  if (j.contains("intermediate_layers_indices") && !j["intermediate_layers_indices"].is_null())
    c.intermediate_layers =
        int_list(j, "intermediate_layers_indices", where + ": vision_config", 0, c.layers - 1);
  else
    c.intermediate_layers = {3, 7, 15, 23, 30};  // MllamaVisionConfig's default
  for (int64_t i : c.intermediate_layers)
    LVX_CHECK(i < c.layers, where, ": intermediate_layers_indices: ", i,
              " is not below num_hidden_layers (", c.layers, ")");
  c.output_dim = config_int_in_or(j, "vision_output_dim", where, 1, kMaxConfigWidth * 64, 7680);
  const int64_t want = c.hidden * (1 + static_cast<int64_t>(c.intermediate_layers.size()));
  LVX_CHECK(c.output_dim == want, where, ": vision_output_dim (", c.output_dim,
            ") must be hidden_size × (1 + len(intermediate_layers_indices)) = ", want);
  if (j.contains("supported_aspect_ratios") && !j["supported_aspect_ratios"].is_null()) {
    const auto& a = j["supported_aspect_ratios"];
    LVX_CHECK(a.is_array() && !a.empty() && a.size() <= 4096, where,
              ": supported_aspect_ratios: expected a non-empty list of [h, w] pairs");
    for (const auto& p : a) {
      LVX_CHECK(p.is_array() && p.size() == 2 && p[0].is_number_integer() &&
                    p[1].is_number_integer() && p[0].get<int64_t>() >= 1 &&
                    p[1].get<int64_t>() >= 1 &&
                    p[0].get<int64_t>() * p[1].get<int64_t>() <= c.max_num_tiles,
                where, ": supported_aspect_ratios: expected [h, w] with 1 ≤ h·w ≤ max_num_tiles (",
                c.max_num_tiles, "), got ", p.dump());
      c.aspect_ratios.push_back({p[0].get<int64_t>(), p[1].get<int64_t>()});
    }
  } else {
    // get_all_supported_aspect_ratios(max_num_tiles): every (w, h) with w·h ≤ max_num_tiles, in
    // width-major order (the release's list for 4 tiles).
    for (int64_t w = 1; w <= c.max_num_tiles; ++w)
      for (int64_t h = 1; h <= c.max_num_tiles; ++h)
        if (w * h <= c.max_num_tiles) c.aspect_ratios.push_back({w, h});
  }
  const int64_t side = c.image_size / c.patch_size;
  LVX_CHECK(side * side + 1 <= (int64_t{1} << 20), where, ": image_size / patch_size gives ",
            side * side, " patches per tile, too many");
  return c;
}

}  // namespace

int64_t VisionConfig::patches() const {
  const int64_t s = image_size / patch_size;
  return s * s;
}
int64_t VisionConfig::tokens_per_tile() const { return patches() + 1; }

bool TextConfig::is_cross(int64_t layer) const {
  return std::find(cross_layers.begin(), cross_layers.end(), layer) != cross_layers.end();
}

int64_t Config::tokens_per_image() const { return vision.max_num_tiles * vision.tokens_per_tile(); }

Config config_from_json(const nlohmann::json& config, const std::string& where) {
  LVX_CHECK(config.is_object(), where, ": expected a JSON object");
  const std::string type = config_string_or(config, "model_type", where, "");
  LVX_CHECK(type == "mllama", where, ": model_type: expected \"mllama\", got \"", type, "\"");
  Config c;
  c.text = text_config(sub_object(config, "text_config", where), where + ": text_config");
  c.vision = vision_config(sub_object(config, "vision_config", where), where + ": vision_config");
  // image_token_index (the release: 128256 = text vocab_size, one of embed_tokens' + 8 rows).
  c.image_token_id =
      config_int_in_or(config, "image_token_index", where, 0, c.text.vocab + 7, 128256);
  return c;
}

ShapeSpec shapes(const Config& c) {
  ShapeSpec s;
  const TextConfig& t = c.text;
  const VisionConfig& v = c.vision;
  const int64_t H = t.hidden, D = t.head_dim, kv = t.kv_heads * D, q = t.heads * D;
  s[kLm + "embed_tokens.weight"] = {t.vocab + 8, H};
  s[kLm + "norm.weight"] = {H};
  if (!t.tie_embeddings) s["language_model.lm_head.weight"] = {t.vocab, H};
  for (int64_t i = 0; i < t.layers; ++i) {
    const std::string p = kLm + "layers." + std::to_string(i) + ".";
    s[p + "input_layernorm.weight"] = {H};
    s[p + "post_attention_layernorm.weight"] = {H};
    s[p + "mlp.gate_proj.weight"] = {t.intermediate, H};
    s[p + "mlp.up_proj.weight"] = {t.intermediate, H};
    s[p + "mlp.down_proj.weight"] = {H, t.intermediate};
    const std::string a = p + (t.is_cross(i) ? "cross_attn." : "self_attn.");
    s[a + "q_proj.weight"] = {q, H};
    s[a + "k_proj.weight"] = {kv, H};
    s[a + "v_proj.weight"] = {kv, H};
    s[a + "o_proj.weight"] = {H, q};
    if (t.is_cross(i)) {
      s[a + "q_norm.weight"] = {D};
      s[a + "k_norm.weight"] = {D};
      s[p + "cross_attn_attn_gate"] = {1};
      s[p + "cross_attn_mlp_gate"] = {1};
    }
  }
  s["multi_modal_projector.weight"] = {H, v.output_dim};
  s["multi_modal_projector.bias"] = {H};
  const int64_t W = v.hidden, T = v.tokens_per_tile(), tiles = v.max_num_tiles;
  const int64_t ratios = static_cast<int64_t>(v.aspect_ratios.size()) + 1;
  s[kVision + "patch_embedding.weight"] = {W, 3, v.patch_size, v.patch_size};
  s[kVision + "class_embedding"] = {W};
  s[kVision + "gated_positional_embedding.gate"] = {1};
  s[kVision + "gated_positional_embedding.embedding"] = {T, W};
  s[kVision + "gated_positional_embedding.tile_embedding.weight"] = {ratios, tiles * T * W};
  for (const std::string e :
       {"pre_tile_positional_embedding.", "post_tile_positional_embedding."}) {
    s[kVision + e + "gate"] = {1};
    s[kVision + e + "embedding.weight"] = {ratios, tiles * W};
  }
  for (const std::string n : {"layernorm_pre.", "layernorm_post."}) {
    s[kVision + n + "weight"] = {W};
    s[kVision + n + "bias"] = {W};
  }
  auto encoder = [&](const std::string& e, int64_t layers, bool gated) {
    for (int64_t i = 0; i < layers; ++i) {
      const std::string p = kVision + e + ".layers." + std::to_string(i) + ".";
      for (const std::string pr : {"q_proj", "k_proj", "v_proj", "o_proj"})
        s[p + "self_attn." + pr + ".weight"] = {W, W};
      s[p + "mlp.fc1.weight"] = {v.intermediate, W};
      s[p + "mlp.fc1.bias"] = {v.intermediate};
      s[p + "mlp.fc2.weight"] = {W, v.intermediate};
      s[p + "mlp.fc2.bias"] = {W};
      for (const std::string n : {"input_layernorm.", "post_attention_layernorm."}) {
        s[p + n + "weight"] = {W};
        s[p + n + "bias"] = {W};
      }
      if (gated) {
        s[p + "gate_attn"] = {1};
        s[p + "gate_ffn"] = {1};
      }
    }
  };
  encoder("transformer", v.layers, false);
  encoder("global_transformer", v.global_layers, true);
  return s;
}

at::Tensor rope_inv_freq(const TextConfig& c, const at::TensorOptions& o) {
  // _compute_default_rope_parameters: 1 / base^(arange(0, D, 2).float() / D), in fp32.
  const auto f32 = o.dtype(at::kFloat);
  const int64_t D = c.head_dim;
  at::Tensor exponent =
      at::arange(0, D, 2, f32.dtype(at::kLong)).to(at::kFloat) / static_cast<double>(D);
  at::Tensor inv = 1.0 / at::pow(at::scalar_tensor(c.rope_theta, f32), exponent);
  if (c.rope_type != "llama3") return inv;
  // _compute_llama3_parameters, op for op in fp32 tensors (Python floats as scalars).
  const double factor = c.rope_factor, low = c.low_freq_factor, high = c.high_freq_factor;
  const double old_len = static_cast<double>(c.original_max_positions);
  const double low_wavelen = old_len / low, high_wavelen = old_len / high;
  at::Tensor wavelen = (2 * M_PI) / inv;
  at::Tensor llama = at::where(wavelen > low_wavelen, inv / factor, inv);
  at::Tensor smooth = (old_len / wavelen - low) / (high - low);
  at::Tensor smoothed = (1 - smooth) * llama / factor + smooth * llama;
  at::Tensor medium =
      at::logical_not(wavelen < high_wavelen) * at::logical_not(wavelen > low_wavelen);
  return at::where(medium, smoothed, llama);
}

ModelConfig planner_model(const Config& c) {
  ModelConfig m;
  m.name = "mllama";
  m.family = "mllama";
  m.dtype = "bf16";
  m.visual_tokens_per_frame = c.tokens_per_image();
  m.visual_feature_dim = c.text.hidden;  // the projector's output is what the cross layers read
  m.vision = {c.vision.hidden,     c.vision.layers + c.vision.global_layers,
              c.vision.heads,      c.vision.intermediate,
              c.vision.image_size, c.vision.patch_size};
  for (int64_t i = 0; i < c.text.layers; ++i) {
    AttentionLayerConfig l;
    l.hidden_size = c.text.hidden;
    l.heads = c.text.heads;
    l.kv_heads = c.text.kv_heads;
    l.head_dim = c.text.head_dim;
    l.mlp_size = c.text.intermediate;
    // A cross layer replaces the decoder layer: no self-attention in it.
    l.kind = c.text.is_cross(i) ? LayerKind::kCross : LayerKind::kSelf;
    // The planner prices a video prompt: the frames' <|image|> tokens are one run, so each token
    // sees the images up to its own and the text after the run sees them all (the processor's
    // group rule, models/mllama/mask.h; the runtime runs it as one up-to call).
    l.mask = c.text.is_cross(i) ? MaskRule::kMediaUpTo : MaskRule::kCausal;
    m.layers.push_back(l);
  }
  return m;
}

}  // namespace lvx::models::mllama
