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

struct Reference {
  std::string model, batch, expected;
};

const Reference& reference(const std::string& lm) {
  static std::map<std::string, Reference> made;
  auto it = made.find(lm);
  if (it != made.end()) return it->second;
  const std::string script = std::string(LVX_SOURCE_DIR) + "/tests/reference/openflamingo_ref.py";
  const std::string converter = std::string(LVX_SOURCE_DIR) + "/models/convert_openflamingo.py";
  const std::string py = python() + " " + script + " ";
  std::string log;
  const std::string d = generated(
      "openflamingo_" + lm, script_stamp(script) + read_text(converter),
      [&](const std::string& dir) {
        const std::string model = dir + "/model", batch = dir + "/batch.safetensors";
        // One after the other (the operands of + have no evaluation order).
        // "gpt_neox-variant": partial rotary, parallel residual, ViT tokens before ln_post.
        const bool variant = lm == "gpt_neox-variant";
        std::string out = run_command(py + "make-model " + model + " --lm " +
                                      (variant ? "gpt_neox --rotary-pct 0.25 --parallel-residual "
                                                 "--tokens-ln-post false"
                                               : lm));
        out += run_command(py + "make-batch " + model + " " + batch);
        out += run_command(py + "run " + model + " " + batch + " " + dir +
                           "/expected.safetensors --backward");
        return out;
      },
      &log);
  EXPECT_FALSE(d.empty()) << log;
  return made[lm] = {d + "/model", d + "/batch.safetensors", d + "/expected.safetensors"};
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
  const Reference& ref = reference(c.lm);
  const std::string out = (workdir() / ("of_" + c.lm + "_out.safetensors")).string();
  fs::remove(out);
  const std::string log =
      run_command(lvx_binary() + " forward --model " + ref.model + " --input " + ref.batch +
                  " --output " + out + " --nproc " + std::to_string(c.nproc) + " --strategies " +
                  c.strategies + " --backward " + c.flags);
  ASSERT_TRUE(fs::exists(out)) << log;
  const Diff d = compare(out, ref.expected);
  std::cout << c.lm << " n=" << c.nproc << " " << c.strategies << ": logits " << d.logits
            << ", loss " << d.loss << ", grads " << d.grad << " (" << d.worst_grad << ", "
            << d.grads << " tensors)\n";
  expect_conforms(d, 1e-4, 1e-4, 60);
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
                           std::string s = info.param.strategies;
                           for (char& ch : s)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           std::string name = info.param.lm + "_n" +
                                              std::to_string(info.param.nproc) + "_" + s +
                                              (info.param.flags.empty() ? "" : "_remat");
                           for (char& ch : name)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return name;
                         });

}  // namespace
