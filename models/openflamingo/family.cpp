// OpenFlamingo's answers to the runtime (models/family.h): its VQA evaluation prompt, CLIP
// preprocessing and the cross_only freeze recipe.
#include <memory>

#include "models/openflamingo/model.h"
#include "models/openflamingo/release.h"
#include "models/prompt.h"
#include "models/tokenizer/tokenizer.h"
#include "src/common/error.h"

namespace lvx::models::openflamingo {

namespace {

class OpenFlamingoFamily final : public Family {
 public:
  std::string model_type() const override { return "openflamingo"; }
  std::string display_name() const override { return "OpenFlamingo"; }

  std::unique_ptr<Model> load(const Checkpoint& ck, at::ScalarType dtype,
                              at::Device device) const override {
    return std::make_unique<OpenFlamingo>(ck, dtype, device);
  }

  ReleaseLayout release_layout(const nlohmann::json& config,
                               const std::string& where) const override {
    return openflamingo::release_layout(config, where);
  }
  nlohmann::json resize_release(const nlohmann::json& config, const ReleaseResize& r,
                                const std::string& where) const override {
    return openflamingo::resize_release(config, r, where);
  }
  ModelConfig planner_model(const nlohmann::json& config, const std::string& where) const override {
    return OpenFlamingo::planner_model(openflamingo_config(config, where));
  }

  ShapeSpec parameter_shapes(const nlohmann::json& config,
                             const std::string& where) const override {
    return openflamingo_shapes(openflamingo_config(config, where));
  }

  // The VQA evaluation prompt; each frame an <image> followed by <|endofchunk|>:
  //   <image><|endofchunk|>…<image>Question:{question} Short answer:{answer}<|endofchunk|>
  PromptTokens prompt(const Tokenizer& tok, const std::string& question, int64_t frames,
                      const std::string* answer) const override {
    check_prompt_request(question, frames);
    PromptBuilder p(tok);
    for (int64_t f = 0; f < frames; ++f) {
      p.special("<image>");
      if (f + 1 < frames) p.special("<|endofchunk|>");
    }
    p.text("Question:" + question + " Short answer:");
    if (answer) {
      p.text(*answer, true);
      p.special("<|endofchunk|>", true);
    }
    return std::move(p).finish();
  }

  // Later turns follow as the package's few-shot prompts chain examples, each answer and its
  // <|endofchunk|> labelled: ...{answer}<|endofchunk|>Question:{question} Short answer:{answer}
  // <|endofchunk|>
  // The evaluation prompt has no system message: one is refused, as prompt_chat refuses it.
  PromptTokens prompt_turns(const Tokenizer& tok, const std::string& system,
                            const std::vector<std::pair<std::string, std::string>>& turns,
                            int64_t frames) const override {
    refuse_system(system);
    LVX_CHECK(!turns.empty(), "a conversation needs at least one turn");
    PromptTokens all = prompt(tok, turns[0].first, frames, &turns[0].second);
    for (size_t i = 1; i < turns.size(); ++i) {
      check_prompt_request(turns[i].first, frames);
      PromptBuilder p(tok);
      p.text("Question:" + turns[i].first + " Short answer:");
      p.text(turns[i].second, true);
      p.special("<|endofchunk|>", true);
      PromptTokens more = std::move(p).finish();
      // The last label of the part before (−100 after finish's shift) predicts this part's first
      // token, a prompt token: it stays −100.
      all.ids.insert(all.ids.end(), more.ids.begin(), more.ids.end());
      all.labels.insert(all.labels.end(), more.labels.begin(), more.labels.end());
    }
    return all;
  }

  // The same chain, the last question open ("Question:{question} Short answer:"). The
  // evaluation prompt has no system message: one is refused.
  PromptTokens prompt_chat(const Tokenizer& tok, const std::string& system,
                           const std::vector<std::pair<std::string, std::string>>& earlier,
                           const std::string& question, int64_t frames) const override {
    refuse_system(system);
    PromptTokens all;
    if (earlier.empty()) {
      all = prompt(tok, question, frames, nullptr);
    } else {
      all = prompt_turns(tok, system, earlier, frames);
      check_prompt_request(question, frames);
      PromptBuilder p(tok);
      p.text("Question:" + question + " Short answer:");
      const PromptTokens open = std::move(p).finish();
      all.ids.insert(all.ids.end(), open.ids.begin(), open.ids.end());
    }
    all.labels.assign(all.ids.size(), -100);
    return all;
  }

  std::vector<int64_t> media_ids(const Tokenizer& tok, int64_t frames) const override {
    PromptBuilder p(tok);
    for (int64_t f = 0; f < frames; ++f) {
      p.special("<image>");
      if (f + 1 < frames) p.special("<|endofchunk|>");
    }
    PromptTokens t = std::move(p).finish();
    return t.ids;
  }

  std::vector<int64_t> stop_tokens(const Tokenizer& tok) const override {
    std::vector<int64_t> stop{special_token_id(tok, "<|endofchunk|>")};
    if (auto eos = tok.token_to_id("<|endoftext|>")) stop.push_back(*eos);
    return stop;
  }

  std::string preprocess_preset() const override { return "clip"; }

  // only_attend_immediate_media True / False; the derivation: models/openflamingo/model.h.
  std::vector<NamedMediaMaskRule> media_mask_rules() const override {
    return {{"openflamingo", kMediaMaskImmediate},
            {"openflamingo-all-previous", kMediaMaskAllPrevious}};
  }

  // OpenFlamingo's own recipe: the resampler and the gated xattn blocks.
  bool trains_cross_only(const std::string& name) const override {
    return name.rfind("perceiver.", 0) == 0 ||
           name.find(".gated_cross_attn_layer.") != std::string::npos;
  }
};

}  // namespace

const Family& family() {
  static const OpenFlamingoFamily f;
  return f;
}

}  // namespace lvx::models::openflamingo
