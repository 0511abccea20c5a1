// Llama-3.2-Vision's answers to the runtime (models/family.h): model_type "mllama".
#include <memory>

#include "models/mllama/config.h"
#include "models/mllama/model.h"
#include "models/mllama/release.h"
#include "models/mllama/template.h"
#include "models/prompt.h"

namespace lvx::models::mllama {

namespace {

class MllamaFamily : public Family {
 public:
  std::string model_type() const override { return "mllama"; }
  std::string display_name() const override { return "Llama-3.2-Vision"; }
  std::unique_ptr<Model> load(const Checkpoint& ck, at::ScalarType dtype,
                              at::Device device) const override {
    return std::make_unique<Mllama>(ck, dtype, device);
  }
  ReleaseLayout release_layout(const nlohmann::json& config,
                               const std::string& where) const override {
    return mllama::release_layout(config, where);
  }
  nlohmann::json resize_release(const nlohmann::json& config, const ReleaseResize& r,
                                const std::string& where) const override {
    return mllama::resize_release(config, r, where);
  }
  ModelConfig planner_model(const nlohmann::json& config, const std::string& where) const override {
    return mllama::planner_model(config_from_json(config, where));
  }
  ShapeSpec parameter_shapes(const nlohmann::json& config,
                             const std::string& where) const override {
    return shapes(config_from_json(config, where));
  }
  PromptTokens prompt(const Tokenizer& tok, const std::string& question, int64_t frames,
                      const std::string* answer) const override {
    return mllama::prompt(tok, question, frames, answer);
  }
  // One turn (the default's), a system message refused as prompt_chat refuses it.
  PromptTokens prompt_turns(const Tokenizer& tok, const std::string& system,
                            const std::vector<std::pair<std::string, std::string>>& turns,
                            int64_t frames) const override {
    mllama::refuse_system(system);
    return Family::prompt_turns(tok, "", turns, frames);
  }
  PromptTokens prompt_chat(const Tokenizer& tok, const std::string& system,
                           const std::vector<std::pair<std::string, std::string>>& earlier,
                           const std::string& question, int64_t frames) const override {
    return mllama::prompt_chat(tok, system, earlier, question, frames);
  }
  std::vector<int64_t> stop_tokens(const Tokenizer& tok) const override {
    return mllama::stop_tokens(tok);
  }
  std::vector<int64_t> media_ids(const Tokenizer& tok, int64_t frames) const override {
    return std::vector<int64_t>(static_cast<size_t>(frames), special_token_id(tok, "<|image|>"));
  }
  // CLIP's mean/std; lvx resizes the short side and crops the centre to one image_size tile,
  // where MllamaImageProcessor would fit the whole frame into a tile canvas (pads instead of
  // crops) and may use several tiles.
  std::string preprocess_preset() const override { return "clip"; }
  bool trains_cross_only(const std::string& name) const override {
    return mllama::trains_cross_only(name);
  }
};

}  // namespace

const Family& family() {
  static const MllamaFamily f;
  return f;
}

}  // namespace lvx::models::mllama
