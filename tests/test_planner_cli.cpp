// `lvx plan` end to end: the table, the JSON of the format, and errors naming the field.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

namespace {

namespace fs = std::filesystem;

std::string lvx_binary() { return std::string(LVX_BINARY_DIR) + "/lvx"; }

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
  const std::string src = LVX_SOURCE_DIR;
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
  int rc = run(lvx_binary() + " plan --model " + bad + " --cluster " + std::string(LVX_SOURCE_DIR) +
                   "/configs/clusters/a100_80g_16.yaml --frames 1 --text 1",
               &out);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find(bad + ": dtype: missing"), std::string::npos) << out;
  out.clear();
  rc = run(lvx_binary() + " plan --model " + std::string(LVX_SOURCE_DIR) +
               "/configs/models/tiny.yaml --cluster " + std::string(LVX_SOURCE_DIR) +
               "/configs/clusters/a100_80g_16.yaml --frames 8 --text 4",
           &out);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find("--text"), std::string::npos) << out;
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
  const std::string src = LVX_SOURCE_DIR;
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
