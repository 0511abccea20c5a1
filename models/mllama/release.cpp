// Llama-3.2-Vision's released files (Family::release_layout, resize_release): the on-disk names
// transformers' save_pretrained writes for MllamaForConditionalGeneration (every tensor is one
// lvx runs: shapes() in config.cpp), and Llama 3's chat tokens with <|image|> at
// image_token_index (the release: 128256, one of embed_tokens' 8 extra rows).
#include "models/mllama/release.h"

#include <algorithm>

#include "models/mllama/config.h"
#include "models/release_init.h"
#include "src/common/error.h"

namespace lvx::models::mllama {

ReleaseLayout release_layout(const nlohmann::json& config, const std::string& where) {
  const Config c = config_from_json(config, where);
  ReleaseLayout r;
  r.tensors = shapes(c);
  for (const char* s : {"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                        "<|end_header_id|>", "<|eot_id|>"})
    r.specials.push_back({s, -1});
  r.specials.push_back({"<|image|>", c.image_token_id});
  r.embedding_rows = c.text.vocab + 8;
  return r;
}

nlohmann::json resize_release(const nlohmann::json& config, const ReleaseResize& r,
                              const std::string& where) {
  nlohmann::json c = config;
  LVX_CHECK(c.contains("text_config") && c["text_config"].is_object() &&
                c.contains("vision_config") && c["vision_config"].is_object(),
            where, ": expected text_config and vision_config objects");
  nlohmann::json& t = c["text_config"];
  nlohmann::json& v = c["vision_config"];
  if (r.layers > 0) {
    t["cross_attention_layers"] =
        layers_kept(t.value("cross_attention_layers", nlohmann::json::array()), r.layers, 0,
                    r.cross_layers, where + ": text_config.cross_attention_layers");
    t["num_hidden_layers"] = r.layers;
  }
  if (r.vision_layers > 0) {
    // The local encoder's depth and the global one's (at most the release's); the intermediate
    // layers it exports stay those below it (the last one when none is), and the projector's
    // input width follows (hidden × (1 + exported layers)).
    v["num_hidden_layers"] = r.vision_layers;
    v["num_global_layers"] = std::min<int64_t>(r.vision_layers, v.value("num_global_layers", 8));
    nlohmann::json kept = nlohmann::json::array();
    for (const auto& i : v.value("intermediate_layers_indices", nlohmann::json::array()))
      if (i.is_number_integer() && i.get<int64_t>() < r.vision_layers) kept.push_back(i);
    if (kept.empty()) kept.push_back(r.vision_layers - 1);  // transformers needs one: the last
    v["intermediate_layers_indices"] = kept;
    v["vision_output_dim"] = v.value("hidden_size", int64_t{1280}) * (1 + int64_t(kept.size()));
  }
  if (r.vocab > 0) {
    t["vocab_size"] = r.vocab;
    c["image_token_index"] = r.vocab;  // as released: the first of the 8 extra rows
    for (const char* id : {"bos_token_id", "eos_token_id", "pad_token_id"})  // the release's ids
      if (t.contains(id) && t[id].is_number_integer() && t[id].get<int64_t>() >= r.vocab)
        t[id] = nullptr;
  }
  config_from_json(c, where);  // the result is a valid config
  return c;
}

}  // namespace lvx::models::mllama
