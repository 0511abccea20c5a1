// Pieces of lvx bench-plan (tools/bench_plan.h): layer inputs in lvx attention's format, its stats file, regret.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "src/common/error.h"
#include "src/planner/planner.h"
#include "tests/build_paths.h"
#include "tools/bench_plan.h"

namespace lvx::planner {
namespace {

using namespace lvx::tools;  // bench-plan's harness (tools/bench_plan.h)

TEST(PlannerBench, CrossLayerInputsCarryThePlannedMediaIndices) {
  // tiny.yaml's cross layer (media_upto, mPLUG-Owl3's "images strictly before the token"), 4
  // frames of 3 tokens, 10 text tokens, frames interleaved: image tokens at 0, 2, 5, 7.
  ModelConfig m = load_model_config(lvx::testing::source_dir() + "/configs/models/tiny.yaml");
  Workload wl;
  wl.frames = 4;
  wl.text_tokens = 10;
  wl.tokens_per_frame = 3;
  wl.layout = PromptLayout::kInterleaved;
  const LayerWorkload w = layer_workloads(m, wl).back();
  ASSERT_EQ(w.kind, LayerKind::kCross);
  auto t = layer_inputs(w, at::kFloat, 7);
  EXPECT_EQ(t.at("q").sizes(), (at::IntArrayRef{1, 10, 4, 16}));
  EXPECT_EQ(t.at("k").sizes(), (at::IntArrayRef{1, 12, 2, 16}));
  EXPECT_EQ(t.at("do").sizes(), t.at("q").sizes());
  // Token t sees the images whose token is before t: q_media = (#image tokens < t) − 1.
  std::vector<int> qm = {-1, 0, 0, 1, 1, 1, 2, 2, 3, 3}, km = {0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3};
  for (int i = 0; i < 10; ++i) EXPECT_EQ(t.at("q_media")[0][i].item<int>(), qm[i]) << i;
  for (int j = 0; j < 12; ++j) EXPECT_EQ(t.at("kv_media")[0][j].item<int>(), km[j]) << j;
  EXPECT_EQ(t.at("q_media").scalar_type(), at::kInt);
  EXPECT_EQ(attention_mask_flag(w), "media_upto");
  // Deterministic for a seed.
  EXPECT_TRUE(at::equal(t.at("q"), layer_inputs(w, at::kFloat, 7).at("q")));
  const LayerWorkload self = layer_workloads(m, wl).front();
  EXPECT_EQ(layer_inputs(self, at::kFloat, 7).count("q_media"), 0u);
}

TEST(PlannerBench, StatsFileTakesTheSlowestRank) {
  auto p = (std::filesystem::temp_directory_path() / "lvx_test_planner_stats.json").string();
  std::ofstream(p) << R"({"strategy": "ring", "ranks": [
      {"rank": 0, "bytes_sent": 100, "bytes_received": 100, "seconds": 0.5},
      {"rank": 1, "bytes_sent": 120, "bytes_received": 80, "seconds": 0.7}]})";
  AttentionRunStats s = read_attention_stats(p);
  EXPECT_DOUBLE_EQ(s.seconds, 0.7);
  EXPECT_DOUBLE_EQ(s.bytes_sent, 120);
  std::ofstream(p) << R"({"strategy": "ring", "ranks": [{"rank": 0, "bytes_sent": 1}]})";
  try {
    read_attention_stats(p);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ranks[0].seconds: missing"), std::string::npos)
        << e.what();
  }
}

TEST(PlannerBench, RegretIsChoiceOverFastest) {
  std::map<std::string, double> m = {{"ring", 2.0}, {"lv_xattn", 1.0}, {"lv_xattn+ring", 1.5}};
  EXPECT_DOUBLE_EQ(regret(m, "lv_xattn"), 1.0);
  EXPECT_DOUBLE_EQ(regret(m, "ring"), 2.0);
  EXPECT_DOUBLE_EQ(regret(m, "lv_xattn+ring"), 1.5);
  EXPECT_TRUE(std::isnan(regret(m, "ulysses")));
}

}  // namespace
}  // namespace lvx::planner

// ---- calibrate's ring sweep on real ranks ------------------------------------------------

#include "src/planner/calibrate.h"
#include "tests/multirank.h"

namespace {

// Every rank times ring steps of three sizes; the byte counters must show exactly the messages
// the sweep claims (warm-up + reps per size, each `size` bytes to the next rank).
LVX_WORKER(calibrate_sweep) {
  auto pg = lvx::dist::ProcessGroup::from_env();
  const std::vector<int64_t> sizes = {8, 4096, 65536};
  const int reps = 3;
  pg->counters().reset();
  std::vector<double> t = lvx::planner::measure_ring_steps(*pg, sizes, at::Device(at::kCPU), reps);
  int64_t expect = 0;
  for (int64_t s : sizes) expect += s * (reps + 1);
  const int64_t sent = pg->counters().sent[static_cast<size_t>(pg->next())];
  if (sent != expect) {
    std::fprintf(stderr, "rank %d sent %lld bytes to next, expected %lld\n", pg->rank(),
                 static_cast<long long>(sent), static_cast<long long>(expect));
    return 1;
  }
  for (double x : t) {
    if (!(x > 0 && x < 10)) {
      std::fprintf(stderr, "implausible step time %g s\n", x);
      return 1;
    }
  }
  return 0;
}

TEST(PlannerCalibrate, RingSweepOnRealRanksMovesWhatItTimes) {
  lvx::testing::expect_all_ok(lvx::testing::run_ranks(3, "calibrate_sweep", 120));
}

}  // namespace
