// The registry of model families (models/family.h): one line per family folder under models/.
#include <utility>

#include "models/checkpoint.h"
#include "models/family.h"
#include "models/mllama/model.h"
#include "models/mplug_owl3/model.h"
#include "models/openflamingo/model.h"
#include "src/common/error.h"

namespace lvx::models {

const std::vector<const Family*>& families() {
  static const std::vector<const Family*> all = {
      &mplug_owl3::family(),
      &openflamingo::family(),
      &mllama::family(),
  };
  return all;
}

void Family::refuse_system(const std::string& system) const {
  LVX_CHECK(system.empty(), display_name(), "'s prompt template has no system message");
}

PromptTokens Family::prompt_turns(const Tokenizer& tok, const std::string& system,
                                  const std::vector<std::pair<std::string, std::string>>& turns,
                                  int64_t frames) const {
  refuse_system(system);
  LVX_CHECK(turns.size() == 1, display_name(), "'s prompt template takes one question and answer; ",
            "a conversation of ", turns.size(), " turns is not supported for it");
  return prompt(tok, turns[0].first, frames, &turns[0].second);
}

PromptTokens Family::prompt_chat(const Tokenizer& tok, const std::string& system,
                                 const std::vector<std::pair<std::string, std::string>>& earlier,
                                 const std::string& question, int64_t frames) const {
  refuse_system(system);
  LVX_CHECK(earlier.empty(), display_name(), "'s prompt template takes one question; ",
            "a conversation of ", earlier.size() + 1, " turns is not supported for it");
  PromptTokens p = prompt(tok, question, frames);
  p.labels.assign(p.ids.size(), -100);
  return p;
}

std::string supported_model_types() {
  std::string s;
  for (const Family* f : families()) s += (s.empty() ? "" : ", ") + f->model_type();
  return s;
}

const Family& family_of(const std::string& model_type, const std::string& where) {
  for (const Family* f : families())
    if (f->model_type() == model_type) return *f;
  LVX_FAIL(where, ": model_type '", model_type,
           "' is not supported (supported: ", supported_model_types(), ")");
}

std::vector<NamedMediaMaskRule> named_media_mask_rules() {
  std::vector<NamedMediaMaskRule> all;
  for (const Family* f : families())
    for (NamedMediaMaskRule& r : f->media_mask_rules()) all.push_back(std::move(r));
  return all;
}

attention::MediaMaskRule media_mask_rule(const std::string& name) {
  std::string valid;
  for (const NamedMediaMaskRule& r : named_media_mask_rules()) {
    if (r.name == name) return r.rule;
    valid += (valid.empty() ? "" : ", ") + r.name;
  }
  if (auto r = attention::media_mask_rule_by_meaning(name)) return *r;
  for (const attention::MediaMaskRule& r : attention::media_mask_rules())
    valid += (valid.empty() ? "" : ", ") + attention::media_mask_rule_name(r);
  LVX_FAIL("media mask model: expected one of ", valid, "; got '", name, "'");
}

const Family& family_of_config(const nlohmann::json& config, const std::string& where) {
  return family_of(config_string_or(config, "model_type", where, ""), where);
}

}  // namespace lvx::models
