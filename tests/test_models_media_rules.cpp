// The released models' media mask rules by name (models/family.h: Family::media_mask_rules,
// models::media_mask_rule): each family's names map to the rule by meaning that
// tests/test_attention_media.cpp checks against the model's own mask code under the same name,
// and unknown names are an error listing every valid one.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "models/family.h"
#include "src/attention/media_mask.h"
#include "src/common/error.h"

namespace lvx::models {
namespace {

using attention::MediaMaskRule;
using attention::MediaSees;

// As stated in tests/test_attention_media.cpp (written from the models' mask code).
struct NamedRule {
  std::string name;
  MediaMaskRule rule;
};
const std::vector<NamedRule> kModels = {
    {"openflamingo", {MediaSees::kMostRecent, true}},
    {"openflamingo-all-previous", {MediaSees::kUpToMostRecent, true}},
    {"mplug-owl3-240728", {MediaSees::kUpToMostRecent, false}},
    {"mplug-owl3-241101", {MediaSees::kUpToMostRecent, true}}};

TEST(MediaMaskRules, NamesParseAndUnknownListsValidNames) {
  for (const auto& model : kModels) {
    SCOPED_TRACE(model.name);
    EXPECT_EQ(media_mask_rule(model.name), model.rule);
  }
  EXPECT_EQ(media_mask_rule("mplug-owl3-241014"), kModels[2].rule);
  EXPECT_EQ(named_media_mask_rules().size(), 5u);
  try {
    media_mask_rule("flamingo");
    FAIL() << "no error for an unknown name";
  } catch (const lvx::Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'flamingo'"), std::string::npos) << msg;
    for (const auto& named : named_media_mask_rules())
      EXPECT_NE(msg.find(named.name), std::string::npos) << msg;
    for (const auto& r : attention::media_mask_rules())
      EXPECT_NE(msg.find(attention::media_mask_rule_name(r)), std::string::npos) << msg;
  }
}

// The rules by meaning are accepted too, besides the families' names.
TEST(MediaMaskRules, RulesByMeaningAreAccepted) {
  for (const auto& r : attention::media_mask_rules())
    EXPECT_EQ(media_mask_rule(attention::media_mask_rule_name(r)), r);
}

}  // namespace
}  // namespace lvx::models
