// OpenFlamingo's released files as lvx loads them (Family::release_layout, resize_release): the
// converted layout that models/openflamingo/convert_openflamingo.py writes from a release's
// checkpoint.pt, language model and open_clip tower (open_flamingo's Flamingo module names),
// with open_clip's contrastive projection (visual.proj), which Flamingo never runs, and the
// special tokens at the ids config.json fixes (<|endofchunk|>, <image>, <PAD>).
#include "models/openflamingo/release.h"

#include "models/openflamingo/model.h"
#include "models/release_init.h"
#include "src/common/error.h"

namespace lvx::models::openflamingo {

ReleaseLayout release_layout(const nlohmann::json& config, const std::string& where) {
  const OpenFlamingoConfig c = openflamingo_config(config, where);
  ReleaseLayout r;
  r.tensors = openflamingo_shapes(c);
  const std::string vis = "vision_encoder.";
  const int64_t out = config_int_in(config["vision_config"], "output_dim",
                                    where + ": vision_config", 1, kMaxConfigWidth);
  r.tensors[vis + "proj"] = {c.v_width, out};
  if (!c.v_tokens_ln_post) {  // the tower's final norm, which tokens taken before it skip
    r.tensors[vis + "ln_post.weight"] = {c.v_width};
    r.tensors[vis + "ln_post.bias"] = {c.v_width};
  }
  r.specials.push_back({"<|endoftext|>", -1});
  r.specials.push_back({"<|endofchunk|>", config_int_in(config, "endofchunk_token_id", where, 0,
                                                        c.vocab - 1)});
  r.specials.push_back({"<image>", c.media_token_id});
  if (config.contains("pad_token_id") && config["pad_token_id"].is_number_integer())
    r.specials.push_back({"<PAD>", config_int_in(config, "pad_token_id", where, 0, c.vocab - 1)});
  r.embedding_rows = c.vocab;
  return r;
}

nlohmann::json resize_release(const nlohmann::json& config, const ReleaseResize& r,
                              const std::string& where) {
  nlohmann::json c = config;
  LVX_CHECK(c.contains("text_config") && c["text_config"].is_object() &&
                c.contains("vision_config") && c["vision_config"].is_object(),
            where, ": expected text_config and vision_config objects");
  nlohmann::json& t = c["text_config"];
  if (r.layers > 0) {
    c["cross_attn_layers"] = layers_kept(c.value("cross_attn_layers", nlohmann::json::array()),
                                         r.layers, 0, r.cross_layers, where + ": cross_attn_layers");
    c["num_decoder_layers"] = r.layers;
    t[t.value("model_type", "") == "mpt" ? "n_layers" : "num_hidden_layers"] = r.layers;
  }
  if (r.vision_layers > 0) c["vision_config"]["layers"] = r.vision_layers;
  if (r.vocab > 0) {
    LVX_CHECK(r.vocab >= 4, where, ": --vocab ", r.vocab, " leaves no room for OpenFlamingo's ",
              "<|endofchunk|>, <image> and <PAD> (the last three ids)");
    c["vocab_size"] = r.vocab;
    c["base_vocab_size"] = r.vocab;
    t["vocab_size"] = r.vocab;
    c["endofchunk_token_id"] = r.vocab - 3;
    c["media_token_id"] = r.vocab - 2;
    c["pad_token_id"] = r.vocab - 1;
  }
  openflamingo_config(c, where);  // the result is a valid config
  return c;
}

}  // namespace lvx::models::openflamingo
