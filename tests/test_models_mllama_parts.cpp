// The parts of the Llama-3.2-Vision (Mllama) family that do not need the distributed model: its
// config.json parsing, checkpoint shapes, llama3 RoPE frequencies, planner view, the tiled vision
// tower + projector and the chat template, each against transformers / tokenizers
// (tests/reference/mllama_ref.py: transformers' own MllamaForConditionalGeneration on a tiny
// random checkpoint written by save_pretrained).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "models/checkpoint.h"
#include "models/mllama/config.h"
#include "models/mllama/template.h"
#include "models/mllama/vision.h"
#include "models/tokenizer/tokenizer.h"
#include "src/common/error.h"
#include "src/common/safetensors.h"
#include "src/dist/process_group.h"
#include "tests/build_paths.h"
#include "tests/model_conformance.h"
#include "tests/multirank.h"

namespace {

using namespace lvx::testing;
namespace ml = lvx::models::mllama;

std::string ref_script() { return lvx::testing::source_dir() + "/tests/reference/mllama_ref.py"; }

// The reference checkpoint, a processor-shaped batch and transformers' intermediates (vision
// output after the projector, RoPE inv_freq), made once per script/package version.
struct Parts {
  std::string model, batch, expected;
};
const Parts& parts() {
  static const Parts p = [] {
    const std::string py = python() + " " + ref_script() + " ";
    std::string log;
    const std::string d = generated(
        "mllama_parts", script_stamp(ref_script()),
        [&](const std::string& dir) {
          std::string out = run_command(py + "make-model " + dir + "/model");
          out += run_command(py + "make-batch " + dir + "/model " + dir + "/batch.safetensors");
          out += run_command(py + "run " + dir + "/model " + dir + "/batch.safetensors " + dir +
                             "/expected.safetensors --intermediates");
          return out;
        },
        &log);
    EXPECT_FALSE(d.empty()) << log;
    return Parts{d + "/model", d + "/batch.safetensors", d + "/expected.safetensors"};
  }();
  return p;
}

nlohmann::json ref_config() {
  return nlohmann::json::parse(read_text(parts().model + "/config.json"));
}

// The error config_from_json raises for `j` ("" when it accepts it).
std::string config_error(const nlohmann::json& j) {
  try {
    ml::config_from_json(j, "config.json");
  } catch (const lvx::Error& e) {
    return e.what();
  }
  return "";
}

TEST(MllamaConfig, ReadsTheReferenceConfig) {
  const ml::Config c = ml::config_from_json(ref_config(), "config.json");
  EXPECT_EQ(c.text.hidden, 64);
  EXPECT_EQ(c.text.layers, 5);
  EXPECT_EQ(c.text.head_dim, 16);
  EXPECT_EQ(c.text.kv_heads, 2);
  EXPECT_EQ(c.text.cross_layers, (std::vector<int64_t>{1, 3}));
  EXPECT_TRUE(c.text.is_cross(3) && !c.text.is_cross(2));
  EXPECT_EQ(c.text.rope_type, "llama3");
  EXPECT_EQ(c.text.original_max_positions, 64);
  EXPECT_EQ(c.vision.heads, 2);  // config.json's attention_heads
  EXPECT_EQ(c.vision.global_layers, 1);
  EXPECT_EQ(c.vision.output_dim, 96);
  EXPECT_EQ(c.vision.tokens_per_tile(), 17);
  EXPECT_EQ(c.tokens_per_image(), 34);
  EXPECT_EQ(c.vision.aspect_ratios.size(), 3u);
  EXPECT_EQ(c.image_token_id, c.text.vocab);  // as released: <|image|> is an extra embedding row
}

TEST(MllamaConfig, ErrorsNameTheField) {
  const nlohmann::json good = ref_config();
  ASSERT_EQ(config_error(good), "");
  struct Bad {
    std::function<void(nlohmann::json&)> edit;
    std::string field;
  };
  const std::vector<Bad> bad = {
      {[](nlohmann::json& j) { j.erase("text_config"); }, "text_config"},
      {[](nlohmann::json& j) { j["model_type"] = "llama"; }, "model_type"},
      {[](nlohmann::json& j) { j["text_config"]["num_attention_heads"] = 5; },
       "num_attention_heads"},
      {[](nlohmann::json& j) { j["text_config"]["num_key_value_heads"] = 3; },
       "num_key_value_heads"},
      {[](nlohmann::json& j) { j["text_config"]["hidden_size"] = -64; }, "hidden_size"},
      {[](nlohmann::json& j) { j["text_config"]["num_hidden_layers"] = 1 << 20; },
       "num_hidden_layers"},
      {[](nlohmann::json& j) {
         j["text_config"]["cross_attention_layers"] = {1, 5};
       },
       "cross_attention_layers"},
      {[](nlohmann::json& j) {
         j["text_config"]["cross_attention_layers"] = {1, 1};
       },
       "cross_attention_layers"},
      {[](nlohmann::json& j) { j["text_config"]["rope_scaling"]["rope_type"] = "yarn"; },
       "rope_type"},
      {[](nlohmann::json& j) {
         j["text_config"]["rope_scaling"].erase("original_max_position_embeddings");
       },
       "original_max_position_embeddings"},
      {[](nlohmann::json& j) { j["text_config"]["hidden_act"] = "swish2"; }, "hidden_act"},
      {[](nlohmann::json& j) { j["vision_config"]["vision_output_dim"] = 64; },
       "vision_output_dim"},
      {[](nlohmann::json& j) {
         j["vision_config"]["intermediate_layers_indices"] = {0, 2};
       },
       "intermediate_layers_indices"},
      {[](nlohmann::json& j) {
         j["vision_config"]["supported_aspect_ratios"] = {{1, 3}};
       },
       "supported_aspect_ratios"},
      {[](nlohmann::json& j) { j["vision_config"]["attention_heads"] = 3; }, "attention_heads"},
      {[](nlohmann::json& j) { j["vision_config"]["patch_size"] = 32; }, "patch_size"},
      {[](nlohmann::json& j) { j["image_token_index"] = 1 << 30; }, "image_token_index"},
  };
  for (const Bad& b : bad) {
    nlohmann::json j = good;
    b.edit(j);
    const std::string e = config_error(j);
    EXPECT_NE(e.find(b.field), std::string::npos)
        << "error for a bad " << b.field << ": '" << e << "'";
    EXPECT_NE(e.find("config.json"), std::string::npos) << e;
  }
}

TEST(MllamaConfig, ShapesAreTheCheckpointsTensors) {
  const lvx::models::Checkpoint ck = lvx::models::load_checkpoint(parts().model);
  const ml::Config c = ml::config_from_json(ck.config, "config.json");
  const lvx::models::ShapeSpec s = ml::shapes(c);
  EXPECT_EQ(s.size(), ck.tensors.size());
  for (const auto& [name, t] : ck.tensors) {
    auto it = s.find(name);
    ASSERT_NE(it, s.end()) << name << " is in the checkpoint but not in shapes()";
    EXPECT_EQ(std::vector<int64_t>(t.sizes().begin(), t.sizes().end()), it->second) << name;
  }
}

TEST(MllamaConfig, RopeInvFreqIsTransformers) {
  const ml::Config c = ml::config_from_json(ref_config(), "config.json");
  const at::Tensor want = lvx::load_safetensors(parts().expected).tensors.at("rope_inv_freq");
  const at::Tensor got = ml::rope_inv_freq(c.text, at::TensorOptions().dtype(at::kFloat));
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_EQ(got.scalar_type(), at::kFloat);
  const double rel = ((got - want).abs() / want.abs()).max().item<double>();
  std::cout << "rope_inv_freq vs transformers (llama3 scaling): max rel err " << rel << "\n";
  EXPECT_LE(rel, 2e-7);  // fp32, the same ops in the same order: at most an ulp
  // The scaling matters here: without it the frequencies differ.
  ml::TextConfig plain = c.text;
  plain.rope_type = "default";
  EXPECT_GT((ml::rope_inv_freq(plain, at::TensorOptions()) - want).abs().max().item<double>(),
            1e-3);
}

TEST(MllamaConfig, PlannerModelHasOneAttentionPerDecoderLayer) {
  const ml::Config c = ml::config_from_json(ref_config(), "config.json");
  const lvx::ModelConfig m = ml::planner_model(c);
  ASSERT_EQ(m.layers.size(), 5u);
  for (int64_t i = 0; i < 5; ++i) {
    const bool cross = i == 1 || i == 3;
    EXPECT_EQ(m.layers[i].kind, cross ? lvx::LayerKind::kCross : lvx::LayerKind::kSelf);
    EXPECT_EQ(m.layers[i].mask, cross ? lvx::MaskRule::kMediaUpTo : lvx::MaskRule::kCausal);
    EXPECT_EQ(m.layers[i].kv_heads, 2);
  }
  EXPECT_EQ(m.visual_tokens_per_frame, 34);
  EXPECT_EQ(m.visual_feature_dim, 64);
  EXPECT_EQ(m.vision.layers, 3);
}

TEST(MllamaVision, EncodeImagesIsTransformers) {
  const lvx::models::Checkpoint ck = lvx::models::load_checkpoint(parts().model);
  const ml::Config c = ml::config_from_json(ck.config, "config.json");
  const auto batch = lvx::load_safetensors(parts().batch).tensors;
  const at::Tensor want =
      lvx::load_safetensors(parts().expected).tensors.at("cross_attention_states");
  const at::Tensor& pv = batch.at("pixel_values");  // [B, N, tiles, 3, S, S]
  const int64_t n = pv.size(0) * pv.size(1);
  at::Tensor got =
      ml::encode_images(ck.tensors, c, pv.flatten(0, 1), batch.at("aspect_ratio_ids").flatten(),
                        batch.at("aspect_ratio_mask").flatten(0, 1));
  ASSERT_EQ(got.sizes(), (std::vector<int64_t>{n, 34, 64}));
  const double err = (got - want).abs().max().item<double>();
  const double scale = want.abs().max().item<double>();
  std::cout << "encode_images vs transformers (fp32 vs fp64, " << n
            << " images incl. padding): max abs err " << err << " (largest value " << scale
            << ")\n";
  EXPECT_LE(err, 1e-4 * std::max(1.0, scale));
  // One image alone gives the same tokens (images are encoded independently).
  at::Tensor one = ml::encode_images(ck.tensors, c, pv.flatten(0, 1).narrow(0, 2, 1),
                                     batch.at("aspect_ratio_ids").flatten().narrow(0, 2, 1),
                                     batch.at("aspect_ratio_mask").flatten(0, 1).narrow(0, 2, 1));
  EXPECT_LE((one[0] - want[2]).abs().max().item<double>(), 1e-4 * std::max(1.0, scale));
  // Autograd reaches the projector (fine-tuning trains it).
  lvx::models::StateDict w = ck.tensors;
  w["multi_modal_projector.weight"] =
      w["multi_modal_projector.weight"].clone().requires_grad_(true);
  ml::encode_images(w, c, pv.flatten(0, 1).narrow(0, 0, 1),
                    batch.at("aspect_ratio_ids").flatten().narrow(0, 0, 1),
                    batch.at("aspect_ratio_mask").flatten(0, 1).narrow(0, 0, 1))
      .sum()
      .backward();
  ASSERT_TRUE(w["multi_modal_projector.weight"].grad().defined());
  EXPECT_GT(w["multi_modal_projector.weight"].grad().abs().sum().item<double>(), 0);
}

TEST(MllamaVision, FramesAsSingleTileImages) {
  const ml::Config c = ml::config_from_json(ref_config(), "config.json");
  const at::Tensor frames = at::rand({3, 3, 16, 16}, at::kDouble);
  const ml::Tiled t = ml::frames_as_images(c, frames);
  ASSERT_EQ(t.pixel_values.sizes(), (std::vector<int64_t>{3, 2, 3, 16, 16}));
  EXPECT_EQ(t.pixel_values.scalar_type(), at::kDouble);
  EXPECT_TRUE(at::equal(t.pixel_values.select(1, 0), frames));
  EXPECT_EQ(t.pixel_values.select(1, 1).abs().sum().item<double>(), 0);
  EXPECT_TRUE(at::equal(t.aspect_ratio_ids, at::ones({3}, at::kLong)));  // (1, 1) is id 1
  EXPECT_TRUE(
      at::equal(t.aspect_ratio_mask, at::tensor({1, 0, 1, 0, 1, 0}, at::kLong).view({3, 2})));
  EXPECT_THROW(ml::frames_as_images(c, at::rand({3, 3, 16, 8})), lvx::Error);
  EXPECT_THROW(ml::encode_images({}, c, t.pixel_values.narrow(1, 0, 1), t.aspect_ratio_ids,
                                 t.aspect_ratio_mask),
               lvx::Error);
}

// Tiles across ranks (vision.h encode_tiles): each rank encodes its tiles of every image of the
// reference batch (6 images of 2 tiles, padding images and tiles included), every encoder layer's
// keys and values gathered from the others; its tokens must equal the same tiles' tokens of the
// whole-image encode within 1e-5 (fp32; the attention runs over fewer query rows), and it must
// have sent bytes (the gathers). At 3 ranks, rank 2 holds no tile and takes part in the gathers
// only.
LVX_WORKER(mllama_tiles_across_ranks) {
  const auto pg = lvx::dist::ProcessGroup::from_env();
  const lvx::models::Checkpoint ck = lvx::models::load_checkpoint(parts().model);
  const ml::Config c = ml::config_from_json(ck.config, "config.json");
  const auto batch = lvx::load_safetensors(parts().batch).tensors;
  const at::Tensor px = batch.at("pixel_values").flatten(0, 1),
                   ids = batch.at("aspect_ratio_ids").flatten(),
                   mask = batch.at("aspect_ratio_mask").flatten(0, 1);
  const at::Tensor whole = ml::encode_tiles(ck.tensors, c, px, ids, mask, nullptr);
  const at::Tensor mine = ml::encode_tiles(ck.tensors, c, px, ids, mask, pg.get());
  const ml::TileShare share = ml::tile_share(c.vision.max_num_tiles, pg->rank(), pg->world_size());
  const int64_t T = c.vision.tokens_per_tile();
  const at::Tensor want = whole.narrow(1, share.first * T, share.count * T);
  if (mine.sizes() != want.sizes()) {
    std::cerr << "rank " << pg->rank() << ": shape " << mine.sizes() << " != " << want.sizes()
              << "\n";
    return 1;
  }
  const double err = share.count == 0 ? 0 : (mine - want).abs().max().item<double>();
  std::cerr << "rank " << pg->rank() << " tiles [" << share.first << ", "
            << share.first + share.count << "): |across ranks - whole| " << err << ", sent "
            << pg->counters().total_sent() << " bytes\n";
  return err <= 1e-5 && pg->counters().total_sent() > 0 ? 0 : 1;
}

TEST(MllamaVision, TilesAcrossRanksEqualTheWholeImage) {
  parts();  // made once, before the ranks read it
  EXPECT_EQ(ml::tile_share(4, 1, 2).first, 2);
  EXPECT_EQ(ml::tile_share(4, 2, 3).count, 0);  // 2 + 2 + 0
  EXPECT_EQ(ml::tile_share(4, 1, 3).count, 2);
  for (int nproc : {2, 3}) expect_all_ok(run_ranks(nproc, "mllama_tiles_across_ranks"));
}

// ids of `chat` by the tokenizers package (split at the added tokens, as transformers encodes a
// chat template's output).
std::vector<int64_t> tokenizers_ids(const std::string& chat) {
  const std::string file = (workdir() / "mllama_chat.txt").string();
  std::ofstream(file, std::ios::binary) << chat;
  const std::string out =
      run_command(python() +
                  " -c \"import json,sys; from tokenizers import Tokenizer; "
                  "t=Tokenizer.from_file(sys.argv[1]); "
                  "print('IDS', json.dumps(t.encode(open(sys.argv[2], encoding='utf-8').read(), "
                  "add_special_tokens=False).ids))\" " +
                  parts().model + "/tokenizer.json " + file);
  const size_t at = out.find("IDS ");
  EXPECT_NE(at, std::string::npos) << out;
  if (at == std::string::npos) return {};
  return nlohmann::json::parse(out.substr(at + 4, out.find('\n', at) - at - 4))
      .get<std::vector<int64_t>>();
}

TEST(MllamaTemplate, PromptIsTheChatTemplatesTokens) {
  const lvx::models::Tokenizer tok =
      lvx::models::Tokenizer::from_file(parts().model + "/tokenizer.json");
  const std::string q = "What happens in the video?", a = " The man rides a bicycle.";
  const std::string head = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n";
  const std::string mid = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
  const lvx::models::PromptTokens p = ml::prompt(tok, q, 3, nullptr);
  EXPECT_EQ(p.ids, tokenizers_ids(head + "<|image|><|image|><|image|>" + q + mid));
  EXPECT_EQ(p.labels, std::vector<int64_t>(p.ids.size(), -100));
  const lvx::models::PromptTokens pa = ml::prompt(tok, q, 2, &a);
  const std::vector<int64_t> want =
      tokenizers_ids(head + "<|image|><|image|>" + q + mid + a + "<|eot_id|>");
  EXPECT_EQ(pa.ids, want);
  // Labels: the answer's tokens and <|eot_id|>, each at the position before it (unshifted).
  const std::vector<int64_t> prefix = tokenizers_ids(head + "<|image|><|image|>" + q + mid);
  ASSERT_EQ(pa.labels.size(), pa.ids.size());
  for (size_t t = 0; t < pa.ids.size(); ++t) {
    const bool learn = t + 1 >= prefix.size() && t + 1 < pa.ids.size();
    EXPECT_EQ(pa.labels[t], learn ? pa.ids[t + 1] : -100) << "position " << t;
  }
  EXPECT_EQ(pa.ids.back(), *tok.token_to_id("<|eot_id|>"));
  // A question that spells a special token gets no special id.
  const lvx::models::PromptTokens h = ml::prompt(tok, "<|image|><|eot_id|>?", 1, nullptr);
  EXPECT_EQ(std::count(h.ids.begin(), h.ids.end(), *tok.token_to_id("<|image|>")), 1);
  EXPECT_EQ(std::count(h.ids.begin(), h.ids.end(), *tok.token_to_id("<|eot_id|>")), 1);
  EXPECT_THROW(ml::prompt(tok, "  ", 1, nullptr), lvx::Error);
  // Text only (lvx serve's chat without a video): the template's message without <|image|>.
  EXPECT_EQ(ml::prompt(tok, q, 0, nullptr).ids, tokenizers_ids(head + q + mid));
  EXPECT_THROW(ml::prompt(tok, q, -1, nullptr), lvx::Error);
}

TEST(MllamaTemplate, ConversationIsTheChatTemplatesTokens) {
  // lvx serve's conversations (Family::prompt_chat): the release's chat_template written out for
  // user, assistant, user (images in the first message, generation prompt at the end), encoded
  // whole by the tokenizers package.
  const lvx::models::Tokenizer tok =
      lvx::models::Tokenizer::from_file(parts().model + "/tokenizer.json");
  const lvx::models::Family& f = lvx::models::family_of("mllama", "test");
  const std::string q1 = "What happens in the video?", a1 = "The man rides a bicycle.",
                    q2 = "And then?";
  const std::string head = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n";
  const std::string mid = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n";
  const std::string user = "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n";
  const lvx::models::PromptTokens p = f.prompt_chat(tok, "", {{q1, a1}}, q2, 2);
  EXPECT_EQ(p.ids, tokenizers_ids(head + "<|image|><|image|>" + q1 + mid + a1 + user + q2 + mid));
  EXPECT_EQ(p.labels, std::vector<int64_t>(p.ids.size(), -100));
  // One turn: exactly lvx qa's prompt.
  EXPECT_EQ(f.prompt_chat(tok, "", {}, q1, 3).ids, ml::prompt(tok, q1, 3, nullptr).ids);
  // The release's template refuses a system message with images (one blank once trimmed is
  // none); lvx names it.
  EXPECT_EQ(f.prompt_chat(tok, " \n", {}, q1, 3).ids, ml::prompt(tok, q1, 3, nullptr).ids);
  try {
    f.prompt_chat(tok, "Be brief.", {}, q1, 1);
    ADD_FAILURE() << "a system message was accepted";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("system message"), std::string::npos) << e.what();
  }
}

TEST(MllamaTemplate, StopTokensAndCrossOnlyRecipe) {
  const lvx::models::Tokenizer tok =
      lvx::models::Tokenizer::from_file(parts().model + "/tokenizer.json");
  EXPECT_EQ(ml::stop_tokens(tok), (std::vector<int64_t>{*tok.token_to_id("<|eot_id|>"),
                                                        *tok.token_to_id("<|end_of_text|>")}));
  const lvx::models::Checkpoint ck = lvx::models::load_checkpoint(parts().model);
  int trained = 0;
  for (const auto& [name, t] : ck.tensors) {
    const bool want = name.rfind("multi_modal_projector.", 0) == 0 ||
                      name.find("layers.1.cross_attn") != std::string::npos ||
                      name.find("layers.3.cross_attn") != std::string::npos;
    EXPECT_EQ(ml::trains_cross_only(name), want) << name;
    trained += want;
  }
  EXPECT_EQ(trained, 2 * 8 + 2);  // per cross layer q/k/v/o, q_norm, k_norm, two gates
}

}  // namespace
