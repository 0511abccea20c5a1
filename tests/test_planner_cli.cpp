// `lvx plan` end to end: the table, the JSON of the format, and errors naming the field.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "tests/build_paths.h"

namespace {

namespace fs = std::filesystem;

std::string lvx_binary() { return lvx::testing::binary_dir() + "/lvx"; }

int run(const std::string& cmd, std::string* out) {
  FILE* f = popen((cmd + " 2>&1").c_str(), "r");
  if (f == nullptr) return -1;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out->append(buf, n);
  int st = pclose(f);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TEST(PlannerCli, PlanWritesTableAndJson) {
  if (!fs::exists(lvx_binary())) GTEST_SKIP() << "build the lvx target first";
  const std::string src = lvx::testing::source_dir();
  const std::string json = (fs::temp_directory_path() / "lvx_test_planner_plan.json").string();
  std::string out;
  int rc = run(lvx_binary() + " plan --model " + src + "/configs/models/openflamingo_9b.yaml" +
                   " --cluster " + src + "/configs/clusters/a100_80g_16.yaml" +
                   " --frames 4096 --text 8192 --train --json " + json,
               &out);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("choice"), std::string::npos) << out;
  EXPECT_NE(out.find("why"), std::string::npos) << out;
  nlohmann::json j;
  std::ifstream(json) >> j;
  ASSERT_EQ(j["layers"].size(), 40u);  // 32 self + 8 cross
  int cross = 0;
  for (const auto& l : j["layers"]) {
    EXPECT_TRUE(l["kind"] == "self" || l["kind"] == "cross");
    if (l["kind"] == "cross") {
      ++cross;
      EXPECT_EQ(l["choice"], "lv_xattn");
    }
    for (const char* s : {"lv_xattn", "ring", "striped", "ulysses", "all_gather"}) {
      const auto& p = l["predicted"][s];
      EXPECT_TRUE(p["fwd_s"].is_number() && p["bwd_s"].is_number() && p["mem_bytes"].is_number() &&
                  p["feasible"].is_boolean() && p["reason"].is_string())
          << s;
    }
  }
  EXPECT_EQ(cross, 8);
  EXPECT_GT(j["total"]["time_s"].get<double>(), 0);
}

TEST(PlannerCli, PlanErrorsNameTheField) {
  if (!fs::exists(lvx_binary())) GTEST_SKIP() << "build the lvx target first";
  const std::string bad = (fs::temp_directory_path() / "lvx_test_planner_bad.yaml").string();
  std::ofstream(bad) << "name: x\nfamily: tiny\n";
  std::string out;
  int rc = run(lvx_binary() + " plan --model " + bad + " --cluster " + lvx::testing::source_dir() +
                   "/configs/clusters/a100_80g_16.yaml --frames 1 --text 1",
               &out);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find(bad + ": dtype: missing"), std::string::npos) << out;
  out.clear();
  rc = run(lvx_binary() + " plan --model " + lvx::testing::source_dir() +
               "/configs/models/tiny.yaml --cluster " + lvx::testing::source_dir() +
               "/configs/clusters/a100_80g_16.yaml --frames 8 --text 4",
           &out);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find("--text"), std::string::npos) << out;
}

// `lvx plan --paper-accounting` models everything the paper's implementations did (K/V with all
// query heads, dense masked attention, one flat ring over every GPU), so on the paper clusters
// the CLI reproduces LV-XAttn's measured cross-attention speedups (Tables 3 and 4) for every row
// but the one each cluster was derived from (tests/test_planner_paper.cpp), within 1.6x
// (observed 0.67-1.55x). With the double ring lvx itself runs across nodes, which the flag used
// to keep, the A100 mPLUG-Owl3 rows came out at 0.2-0.3x.
TEST(PlannerCli, PaperAccountingReproducesHeldOutTableRows) {
  if (!fs::exists(lvx_binary())) GTEST_SKIP() << "build the lvx target first";
  struct Row {
    const char* cluster;
    const char* model;
    int text, frames;
    double measured;  // the paper's CA speedup
  };
  const Row rows[] = {
      {"paper_a100_80g_16", "mplug_owl3_7b", 8192, 4096, 7.26},
      {"paper_a100_80g_16", "mplug_owl3_7b", 8192, 2048, 7.41},
      {"paper_a100_80g_16", "mplug_owl3_7b", 4096, 2048, 14.33},
      {"paper_a100_80g_16", "mplug_owl3_2b", 8192, 2048, 7.04},
      {"paper_a100_80g_16", "mplug_owl3_2b", 4096, 2048, 13.52},
      {"paper_a100_80g_16", "mplug_owl3_1b", 8192, 4096, 9.12},
      {"paper_a100_80g_16", "mplug_owl3_1b", 8192, 2048, 8.64},
      {"paper_a100_80g_16", "mplug_owl3_1b", 4096, 2048, 15.32},
      {"paper_a100_80g_16", "openflamingo_9b", 65536, 65536, 1.52},
      {"paper_a100_80g_16", "openflamingo_9b", 65536, 32768, 1.52},
      {"paper_a100_80g_16", "openflamingo_9b", 32768, 32768, 2.10},
      {"paper_a100_80g_16", "openflamingo_3b", 65536, 65536, 1.48},
      {"paper_a100_80g_16", "openflamingo_3b", 65536, 32768, 1.47},
      {"paper_a100_80g_16", "openflamingo_3b", 32768, 32768, 2.14},
      {"paper_a30_24g_8", "mplug_owl3_7b", 1024, 512, 29.96},
      {"paper_a30_24g_8", "mplug_owl3_7b", 1024, 256, 31.31},
      {"paper_a30_24g_8", "mplug_owl3_7b", 512, 256, 45.85},
      {"paper_a30_24g_8", "mplug_owl3_2b", 1024, 256, 20.60},
      {"paper_a30_24g_8", "mplug_owl3_2b", 512, 256, 30.39},
      {"paper_a30_24g_8", "mplug_owl3_1b", 1024, 512, 24.25},
      {"paper_a30_24g_8", "mplug_owl3_1b", 1024, 256, 21.19},
      {"paper_a30_24g_8", "mplug_owl3_1b", 512, 256, 29.44},
      {"paper_a30_24g_8", "openflamingo_9b", 8192, 8192, 4.33},
      {"paper_a30_24g_8", "openflamingo_9b", 8192, 4096, 3.97},
      {"paper_a30_24g_8", "openflamingo_9b", 4096, 4096, 7.20},
      {"paper_a30_24g_8", "openflamingo_3b", 8192, 8192, 4.27},
      {"paper_a30_24g_8", "openflamingo_3b", 8192, 4096, 4.06},
      {"paper_a30_24g_8", "openflamingo_3b", 4096, 4096, 7.14},
  };
  const std::string src = lvx::testing::source_dir();
  const std::string json = (fs::temp_directory_path() / "lvx_test_planner_paper.json").string();
  for (const Row& r : rows) {
    SCOPED_TRACE(std::string(r.model) + " text " + std::to_string(r.text) + " frames " +
                 std::to_string(r.frames) + " on " + r.cluster);
    std::string out;
    ASSERT_EQ(
        run(lvx_binary() + " plan --paper-accounting --train --model " + src + "/configs/models/" +
                r.model + ".yaml --cluster " + src + "/configs/clusters/" + r.cluster +
                ".yaml --frames " + std::to_string(r.frames) + " --text " + std::to_string(r.text) +
                " --json " + json,
            &out),
        0)
        << out;
    nlohmann::json j;
    std::ifstream(json) >> j;
    EXPECT_EQ(j["expand_kv_heads"], true);
    EXPECT_EQ(j["skip_masked_tiles"], false);
    EXPECT_EQ(j["topology_aware_ring"], false);
    double ring = 0, lv = 0;
    for (const auto& l : j["layers"]) {
      if (l["kind"] != "cross") continue;
      EXPECT_EQ(l["choice"], "lv_xattn") << l["explanation"];
      const auto& pr = l["predicted"];
      ring += pr["ring"]["fwd_s"].get<double>() + pr["ring"]["bwd_s"].get<double>();
      lv += pr["lv_xattn"]["fwd_s"].get<double>() + pr["lv_xattn"]["bwd_s"].get<double>();
    }
    ASSERT_GT(lv, 0);
    const double ratio = ring / lv / r.measured;
    std::printf("%-16s text %6d frames %6d on %s: predicted/measured CA speedup %.2f\n", r.model,
                r.text, r.frames, r.cluster, ratio);
    EXPECT_GT(ratio, 1 / 1.6);
    EXPECT_LT(ratio, 1.6);
  }
}

}  // namespace

namespace {

// bench-plan end to end on 2 real ranks: every feasible strategy of the tiny model, and the
// planner's choice when it is a forward+backward pair, runs through `lvx attention`; the bytes
// each rank sent equal the cost model's volumes exactly, the choice reported is the one `lvx
// plan` makes on the same inputs, and the regret is recomputed from the measured times (the
// timings themselves are only reported, never asserted).
TEST(PlannerCli, BenchPlanMeasuredBytesEqualPredicted) {
  if (!fs::exists(lvx_binary())) GTEST_SKIP() << "build the lvx target first";
  const std::string src = lvx::testing::source_dir();
  const std::string json = (fs::temp_directory_path() / "lvx_test_planner_bench.json").string();
  std::string out;
  int rc = run(lvx_binary() + " bench-plan --model " + src + "/configs/models/tiny.yaml" +
                   " --cluster " + src + "/configs/clusters/a100_80g_16.yaml" +
                   " --frames 4 --text 32 --nproc 2 --reps 1 --json " + json,
               &out);
  ASSERT_EQ(rc, 0) << out;
  nlohmann::json j;
  std::ifstream(json) >> j;
  ASSERT_EQ(j["layers"].size(), 3u);
  // The plan bench-plan measured is the one `lvx plan --train` makes for this cluster.
  const std::string plan_json = (fs::temp_directory_path() / "lvx_test_planner_bp.json").string();
  ASSERT_EQ(run(lvx_binary() + " plan --model " + src + "/configs/models/tiny.yaml --cluster " +
                    src + "/configs/clusters/a100_80g_16.yaml --frames 4 --text 32 --nproc 2 " +
                    "--dtype fp32 --train --json " + plan_json,
                &out),
            0)
      << out;
  nlohmann::json planned;
  std::ifstream(plan_json) >> planned;
  int checked = 0;
  for (size_t i = 0; i < j["layers"].size(); ++i) {
    const auto& l = j["layers"][i];
    const std::string choice = l["choice"];
    EXPECT_EQ(choice, planned["layers"][i]["choice"].get<std::string>()) << l.dump();
    // Every feasible strategy (distflash only on causal self-attention layers), plus the choice
    // when it is a pair, ran.
    const size_t pair = choice.find('+') != std::string::npos;
    const size_t feasible = l["kind"] == "self" ? 6u : 5u;
    EXPECT_EQ(l["strategies"].size(), feasible + pair) << l.dump();
    ASSERT_TRUE(l["strategies"].contains(choice)) << l.dump();
    double fastest = 1e300;
    for (const auto& [name, s] : l["strategies"].items()) {
      EXPECT_EQ(s["measured_bytes_sent"].get<double>(), s["predicted_bytes_sent"].get<double>())
          << "layer " << l["index"] << " " << name;
      EXPECT_GT(s["measured_s"].get<double>(), 0);
      fastest = std::min(fastest, s["measured_s"].get<double>());
      ++checked;
    }
    EXPECT_DOUBLE_EQ(l["regret"].get<double>(),
                     l["strategies"][choice]["measured_s"].get<double>() / fastest);
  }
  EXPECT_GE(checked, 15);
}

}  // namespace
