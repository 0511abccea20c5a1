// `lvx attention` end to end on real ranks against PyTorch's scaled_dot_product_attention in
// float64 (tests/reference/sdpa_check.py, an implementation nobody here wrote), through the
// safetensors files a Python user would exchange with lvx. Gate: error <= 2 × the error of
// PyTorch's own same-dtype computation + atol.
#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "src/common/safetensors.h"
#include "tests/build_paths.h"
#include "tests/multirank.h"

namespace {

std::string run(const std::string& cmd) { return lvx::testing::run_command(cmd); }

struct CliCase {
  std::string strategy, mask;
  int nproc;
  at::ScalarType dtype;
};

void PrintTo(const CliCase& c, std::ostream* os) {
  *os << c.strategy << " " << c.mask << " on " << c.nproc << " ranks";
}

class AttentionCli : public ::testing::TestWithParam<CliCase> {};

TEST_P(AttentionCli, MatchesPyTorchSdpaInFloat64) {
  const auto c = GetParam();
  const std::string dir = ::testing::TempDir();
  const std::string in = dir + "/lvx_att_in_" + c.strategy + c.mask + ".safetensors";
  const std::string out = dir + "/lvx_att_out_" + c.strategy + c.mask + ".safetensors";
  const std::string stats = dir + "/lvx_att_stats_" + c.strategy + c.mask + ".json";
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const int64_t B = 2, Sq = 11, Skv = 29, Hq = 4, Hkv = 2, D = 16;
  std::map<std::string, at::Tensor> t{
      {"q", at::randn({B, Sq, Hq, D}, gen).to(c.dtype)},
      {"k", at::randn({B, Skv, Hkv, D}, gen).to(c.dtype)},
      {"v", at::randn({B, Skv, Hkv, D}, gen).to(c.dtype)},
      {"do", at::randn({B, Sq, Hq, D}, gen).to(c.dtype)},
      {"q_media", (at::div(at::arange(Sq) * 3, Sq, "floor") - 1).to(at::kInt).repeat({B, 1})},
      {"kv_media", at::div(at::arange(Skv) * 2, Skv, "floor").to(at::kInt).repeat({B, 1})}};
  lvx::save_safetensors(in, t);
  std::string log = run(lvx::testing::binary_dir() + "/lvx attention --strategy " + c.strategy +
                        " --nproc " + std::to_string(c.nproc) + " --input " + in + " --output " +
                        out + " --mask " + c.mask + " --backward --stats " + stats);
  ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
  std::string py =
      run(lvx::testing::configured_python() + " " + lvx::testing::source_dir() +
          "/tests/reference/sdpa_check.py " + in + " " + out + " " + c.mask + " --backward");
  auto j = nlohmann::json::parse(py.substr(py.rfind('{')));
  const double atol = c.dtype == at::kFloat ? 1e-5 : 1e-2;
  for (const char* k : {"o", "dq", "dk", "dv"}) {
    const double e = j[k], e_same = j[std::string(k) + "_same"];
    EXPECT_LE(e, 2 * e_same + atol) << k << " error " << e << " vs same-dtype " << e_same;
  }
  std::ifstream sf(stats);
  auto s = nlohmann::json::parse(sf);
  EXPECT_EQ(s["strategy"], c.strategy);
  ASSERT_EQ(s["ranks"].size(), static_cast<size_t>(c.nproc));
  if (c.nproc > 1) {
    EXPECT_GT(s["ranks"][0]["bytes_sent"].get<int64_t>(), 0);
  }
  auto o = lvx::load_safetensors(out).tensors;
  EXPECT_EQ(o.at("lse").scalar_type(), at::kFloat);
  EXPECT_EQ(o.at("o").sizes(), t.at("q").sizes());
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AttentionCli,
    ::testing::Values(CliCase{"lv_xattn", "media_upto", 3, at::kFloat},
                      CliCase{"lv_xattn", "media_immediate", 2, at::kBFloat16},
                      CliCase{"ring", "causal", 3, at::kFloat},
                      CliCase{"striped", "causal", 4, at::kBFloat16},
                      CliCase{"ulysses", "none", 2, at::kFloat},
                      CliCase{"all_gather", "media_upto", 3, at::kFloat}),
    [](const auto& info) {
      return info.param.strategy + "_" + info.param.mask + "_n" + std::to_string(info.param.nproc) +
             "_" + (info.param.dtype == at::kFloat ? "f32" : "bf16");
    });

TEST(AttentionCliErrors, BadInputIsNamedAndNothingWritten) {
  const std::string dir = ::testing::TempDir();
  const std::string in = dir + "/lvx_att_bad.safetensors", out = dir + "/lvx_att_bad_out.safetensors";
  std::remove(out.c_str());
  lvx::save_safetensors(in, {{"q", at::zeros({1, 4, 3, 8})}, {"k", at::zeros({1, 4, 2, 8})},
                             {"v", at::zeros({1, 4, 2, 8})}});
  const std::string lvx =
      lvx::testing::binary_dir() + "/lvx attention --nproc 2 --input " + in + " --output " + out;
  std::string log = run(lvx);
  EXPECT_NE(log.find("k has 2 heads, which does not divide q's 3 heads"), std::string::npos) << log;
  EXPECT_NE(log.find("exit status"), std::string::npos);
  lvx::save_safetensors(in, {{"q", at::zeros({1, 4, 4, 8})}, {"k", at::zeros({1, 4, 2, 8})},
                             {"v", at::zeros({1, 4, 2, 8})}});
  log = run(lvx + " --mask media_upto");
  EXPECT_NE(log.find("needs an int32 tensor 'q_media'"), std::string::npos) << log;
  // A scale that overflows the softmax: refused on every rank, nothing written (it wrote NaN).
  lvx::save_safetensors(in, {{"q", at::ones({1, 4, 4, 8})}, {"k", at::ones({1, 4, 2, 8})},
                             {"v", at::ones({1, 4, 2, 8})}});
  log = run(lvx + " --scale 1e300");
  EXPECT_NE(log.find("the attention output is not finite"), std::string::npos) << log;
  EXPECT_NE(log.find("exit status"), std::string::npos) << log;
  log = run(lvx::testing::binary_dir() +
            "/lvx attention --input /nonexistent.safetensors --output " + out);
  EXPECT_NE(log.find("/nonexistent.safetensors: cannot open"), std::string::npos) << log;
  FILE* f = std::fopen(out.c_str(), "r");
  EXPECT_EQ(f, nullptr) << "an output was written for bad input";
  if (f) std::fclose(f);
}

}  // namespace
