// mPLUG-Owl3's answers to the runtime (models/family.h): its Qwen chatml prompt, SigLIP
// preprocessing and the cross_only freeze recipe.
#include <filesystem>
#include <memory>

#include "models/mplug_owl3/model.h"
#include "models/mplug_owl3/release.h"
#include "models/prompt.h"
#include "models/tokenizer/tokenizer.h"
#include "src/common/error.h"

namespace lvx::models::mplug_owl3 {

namespace {

class MplugOwl3Family final : public Family {
 public:
  std::string model_type() const override { return "mplugowl3"; }
  std::string display_name() const override { return "mPLUG-Owl3"; }

  std::unique_ptr<Model> load(const Checkpoint& ck, at::ScalarType dtype,
                              at::Device device) const override {
    // Shapes only (meta) may come from config.json alone, before anything else is downloaded:
    // without a tokenizer there is no image token to know, and none is needed to size (id 0
    // stands in; such a model is for its parameters only).
    if (device.is_meta() && !std::filesystem::exists(ck.dir + "/tokenizer.json"))
      return std::make_unique<MplugOwl3>(ck, 0, dtype, device);
    const Tokenizer tok = Tokenizer::from_file(ck.dir + "/tokenizer.json");
    const auto image = tok.token_to_id("<|image|>");
    LVX_CHECK(image.has_value(), ck.dir, "/tokenizer.json: has no <|image|> token");
    return std::make_unique<MplugOwl3>(ck, *image, dtype, device);
  }

  ShapeSpec parameter_shapes(const nlohmann::json& config,
                             const std::string& where) const override {
    // The 240728/241014 releases' hyper layers own a gate (a few scalars); counted as present.
    return mplug_owl3_shapes(mplug_owl3_config(config, where, /*gated=*/true, 0));
  }

  ReleaseLayout release_layout(const nlohmann::json& config,
                               const std::string& where) const override {
    return mplug_owl3::release_layout(config, where);
  }
  nlohmann::json resize_release(const nlohmann::json& config, const ReleaseResize& r,
                                const std::string& where) const override {
    return mplug_owl3::resize_release(config, r, where);
  }

  ModelConfig planner_model(const nlohmann::json& config, const std::string& where) const override {
    // Shapes only: both releases run a cross layer beside each hyper layer.
    return MplugOwl3::planner_model(mplug_owl3_config(config, where, /*gated=*/true, 0));
  }

  // Qwen chatml; a video is one <|image|> per frame, then "\n"; 241101 brackets the frames with
  // <|start_video_frame|> … <|end_video_frame|> when the tokenizer has them:
  //   <|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|image|>…<|image|>\n{question}<|im_end|>
  //   \n<|im_start|>assistant\n{answer}<|im_end|>
  PromptTokens prompt(const Tokenizer& tok, const std::string& question, int64_t frames,
                      const std::string* answer) const override {
    PromptBuilder p(tok);
    first_turn(p, "", question, frames, answer);
    return std::move(p).finish();
  }

  // Later turns continue the chatml conversation, each answer and its <|im_end|> labelled:
  //   ...{answer}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n
  //   {answer}<|im_end|>
  // A system message goes where prompt_chat puts it (first_turn, the one place for both).
  PromptTokens prompt_turns(const Tokenizer& tok, const std::string& system,
                            const std::vector<std::pair<std::string, std::string>>& turns,
                            int64_t frames) const override {
    LVX_CHECK(!turns.empty(), "a conversation needs at least one turn");
    PromptBuilder p(tok);
    first_turn(p, system, turns[0].first, frames, &turns[0].second);
    for (size_t i = 1; i < turns.size(); ++i)
      later_turn(p, turns[i].first, frames, &turns[i].second);
    return std::move(p).finish();
  }

  // The same turns, the last question open; a system message is the processor's
  // (build_text_qwen): <|im_start|>system\n{system}<|im_end|>.
  PromptTokens prompt_chat(const Tokenizer& tok, const std::string& system,
                           const std::vector<std::pair<std::string, std::string>>& earlier,
                           const std::string& question, int64_t frames) const override {
    PromptBuilder p(tok);
    for (size_t i = 0; i < earlier.size(); ++i) {
      if (i == 0)
        first_turn(p, system, earlier[i].first, frames, &earlier[i].second);
      else
        later_turn(p, earlier[i].first, frames, &earlier[i].second);
    }
    if (earlier.empty())
      first_turn(p, system, question, frames, nullptr);
    else
      later_turn(p, question, frames, nullptr);
    PromptTokens out = std::move(p).finish();
    out.labels.assign(out.ids.size(), -100);
    return out;
  }

  void first_turn(PromptBuilder& p, const std::string& system, const std::string& question,
                  int64_t frames, const std::string* answer) const {
    check_prompt_request(question, frames);
    p.special("<|im_start|>");
    p.text("system\n" + system);
    p.special("<|im_end|>");
    p.text("\n");
    p.special("<|im_start|>");
    if (frames == 0) {  // text only: the message as the chat template renders it, one piece
      p.text("user\n" + question);
      assistant(p, answer);
      return;
    }
    p.text("user\n");
    const bool bracket = p.has("<|start_video_frame|>") && p.has("<|end_video_frame|>");
    if (bracket) p.special("<|start_video_frame|>");
    for (int64_t f = 0; f < frames; ++f) p.special("<|image|>");
    if (bracket) p.special("<|end_video_frame|>");
    p.text("\n" + question);
    assistant(p, answer);
  }

  void later_turn(PromptBuilder& p, const std::string& question, int64_t frames,
                  const std::string* answer) const {
    check_prompt_request(question, frames);
    p.text("\n");
    p.special("<|im_start|>");
    p.text("user\n" + question);
    assistant(p, answer);
  }

  // The end of the user's turn, the assistant's header and, given, its answer (labelled).
  static void assistant(PromptBuilder& p, const std::string* answer) {
    p.special("<|im_end|>");
    p.text("\n");
    p.special("<|im_start|>");
    p.text("assistant\n");
    if (answer) {
      p.text(*answer, true);
      p.special("<|im_end|>", true);
    }
  }

  std::vector<int64_t> media_ids(const Tokenizer& tok, int64_t frames) const override {
    PromptBuilder p(tok);
    const bool bracket = p.has("<|start_video_frame|>") && p.has("<|end_video_frame|>");
    if (bracket) p.special("<|start_video_frame|>");
    for (int64_t f = 0; f < frames; ++f) p.special("<|image|>");
    if (bracket) p.special("<|end_video_frame|>");
    PromptTokens t = std::move(p).finish();
    return t.ids;
  }

  std::vector<int64_t> stop_tokens(const Tokenizer& tok) const override {
    std::vector<int64_t> stop{special_token_id(tok, "<|im_end|>")};
    if (auto eos = tok.token_to_id("<|endoftext|>")) stop.push_back(*eos);
    return stop;
  }

  std::string preprocess_preset() const override { return "siglip"; }

  // The releases' rules and their derivation: models/mplug_owl3/model.h.
  std::vector<NamedMediaMaskRule> media_mask_rules() const override {
    return {{"mplug-owl3-240728", kMediaMask240728},
            {"mplug-owl3-241101", kMediaMask241101},
            {"mplug-owl3-241014", kMediaMask240728}};
  }

  // No resampler: the hyper layers' visual K/V projection and gate, and the vision-to-text
  // projector.
  bool trains_cross_only(const std::string& name) const override {
    auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
    auto ends = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    return has(".v_kv_proj.") || ends(".self_attn.gate") ||
           name.rfind("vision2text_model.", 0) == 0;
  }
};

}  // namespace

const Family& family() {
  static const MplugOwl3Family f;
  return f;
}

}  // namespace lvx::models::mplug_owl3
