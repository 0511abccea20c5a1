// The released models' media mask rules by name (models/family.h: Family::media_mask_rules,
// models::media_mask_rule): each family's names map to the rule by meaning that
// tests/test_attention_media.cpp checks against the model's own mask code under the same name,
// and unknown names are an error listing every valid one. Also the visual keys each prompt
// position reads under a rule (media_key_reads: the chunked prefill's budget).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "models/decode.h"
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

// media_key_reads against a count made straight from the ids: position t of sample b reads
// tokens_per_media keys per image it sees (every image whose media token is at or before t, or
// before t without own_token_included; the newest only for most-recent), summed over samples.
// Samples with 0, 1 and 3 images (padding slots for the first two); with unmatched_sees_all a
// position that sees no image reads every key of its sample.
TEST(MediaKeyReads, EachPositionReadsTheKeysOfTheImagesItSees) {
  constexpr int64_t kImage = 9, kPerImage = 4;
  const at::Tensor ids = at::tensor({1, 2, 3, 4, 5, 6, 7, 8,   // no image
                                     1, 9, 2, 3, 4, 5, 6, 7,   // one
                                     9, 1, 9, 9, 2, 3, 4, 5},  // three
                                    at::kLong)
                             .view({3, 8});
  const int64_t B = ids.size(0), L = ids.size(1);
  for (const auto& model : kModels) {
    for (bool sees_all : {false, true}) {
      SCOPED_TRACE(model.name + (sees_all ? " unmatched sees all" : ""));
      attention::MediaMask mm = attention::media_mask(model.rule, ids, kImage, kPerImage);
      mm.unmatched_sees_all = sees_all;
      std::vector<int64_t> want(L, 0);
      for (int64_t b = 0; b < B; ++b) {
        int64_t images = 0;
        for (int64_t t = 0; t < L; ++t) images += ids[b][t].item<int64_t>() == kImage;
        int64_t before = 0;  // images whose token is before t
        for (int64_t t = 0; t < L; ++t) {
          const bool own = ids[b][t].item<int64_t>() == kImage;
          const int64_t seen = before + (own && model.rule.own_token_included ? 1 : 0);
          if (seen == 0)
            want[t] += sees_all ? images * kPerImage : 0;
          else
            want[t] += (model.rule.sees == MediaSees::kMostRecent ? 1 : seen) * kPerImage;
          before += own;
        }
      }
      const at::Tensor got = media_key_reads(mm, L);
      ASSERT_EQ(got.sizes(), at::IntArrayRef({L}));
      for (int64_t t = 0; t < L; ++t) EXPECT_EQ(got[t].item<int64_t>(), want[t]) << "t " << t;
      // A prefix: the same counts for its positions.
      EXPECT_TRUE(media_key_reads(mm, 5).equal(got.narrow(0, 0, 5)));
    }
  }
}

}  // namespace
}  // namespace lvx::models
