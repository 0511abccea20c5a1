// OpenFlamingo conformance: tiny random OpenFlamingo models built with the real open-flamingo
// 2.0.1 package (a tiny open_clip ViT, the package's Perceiver resampler and gated
// cross-attention, and transformers' GPT-NeoX, MPT or Llama (GQA)), saved as a release is saved and
// converted by models/convert_openflamingo.py; expected logits, loss and gradients from the
// package's own forward in float64 (tests/reference/openflamingo_ref.py). `lvx forward` must match
// at world sizes 1–4 for every strategy kind. Tolerance (fp32): logits and loss within 1e-4
// absolute (measured ≈3e-6), gradients within 1e-4 of their largest element (measured ≈3e-6).
#include <gtest/gtest.h>

#include <map>

#include "tests/model_conformance.h"

namespace {

using namespace lvx::testing;
namespace fs = std::filesystem;

// "gpt_neox-variant": partial rotary, parallel residual, ViT tokens before ln_post.
const Reference& reference(const std::string& lm) {
  static std::map<std::string, Reference> made;
  auto it = made.find(lm);
  if (it != made.end()) return it->second;
  const std::string script = std::string(LVX_SOURCE_DIR) + "/tests/reference/openflamingo_ref.py";
  const std::string converter = std::string(LVX_SOURCE_DIR) + "/models/convert_openflamingo.py";
  const bool variant = lm == "gpt_neox-variant";
  return made[lm] = reference_model(
             "openflamingo_" + lm, script, script_stamp(script) + read_text(converter),
             "--lm " + (variant ? std::string("gpt_neox --rotary-pct 0.25 --parallel-residual "
                                              "--tokens-ln-post false")
                                : lm),
             "");
}

struct Case {
  std::string lm;
  int nproc;
  std::string strategies;
  std::string flags;  // --remat (DistFlashAttn §3.3)
};

// Readable parameters in test logs (not a byte dump).
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.lm << " on " << c.nproc << " ranks, " << c.strategies << " " << c.flags;
}

class OpenFlamingoConformance : public ::testing::TestWithParam<Case> {};

TEST_P(OpenFlamingoConformance, MatchesThePackage) {
  const Case& c = GetParam();
  expect_conforms(forward_against(reference(c.lm), "of_" + c.lm, c.nproc, c.strategies, c.flags),
                  1e-4, 1e-4, 60);
}

INSTANTIATE_TEST_SUITE_P(Cases, OpenFlamingoConformance,
                         ::testing::Values(Case{"gpt_neox", 1, "lv_xattn,ring", ""},
                                           Case{"gpt_neox", 2, "ring,ulysses", "--remat"},
                                           Case{"gpt_neox", 3, "lv_xattn,striped", ""},
                                           Case{"gpt_neox-variant", 2, "lv_xattn,ring", "--remat"},
                                           Case{"mpt", 1, "lv_xattn,ring", ""},
                                           Case{"mpt", 2, "all_gather,lv_xattn+ring", "--remat"},
                                           Case{"mpt", 4, "lv_xattn,striped", ""},
                                           Case{"llama", 1, "lv_xattn,ring", ""},
                                           Case{"llama", 2, "ulysses,striped", "--remat"},
                                           Case{"llama", 3, "lv_xattn,ring", ""}),
                         [](const auto& info) {
                           return test_name(
                               info.param.lm + "_n" + std::to_string(info.param.nproc) + "_" +
                               info.param.strategies + (info.param.flags.empty() ? "" : "_remat"));
                         });

}  // namespace
