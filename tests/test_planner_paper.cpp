// The planner against LV-XAttn's measurements (Chang et al., "LV-XAttn", Tables 3 and 4: mPLUG-Owl3
// and OpenFlamingo training on 16 A100-80GB and 8 A30-24GB, Ring Attention vs LV-XAttn).
//
// The paper's runs were far from the nominal hardware: its cross-attention kernels ran at about
// 6-15 TFLOP/s and its Ring Attention moved K/V expanded to all query heads over an effective few
// GB/s. So the clusters used here (configs/clusters/paper_*.yaml) take one throughput and one
// bandwidth from ONE row of each table (mPLUG-Owl3-2b, first row; re-derived below), and the
// test checks the other 14 rows of each table: the predicted cross-attention speedup of lv_xattn
// over ring must be within a factor of two of the measured one, and follow the paper's trends.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "src/planner/planner.h"
#include "tests/build_paths.h"

namespace lvx::planner {
namespace {

std::string source(const std::string& rel) { return lvx::testing::source_dir() + "/" + rel; }

struct PaperRow {
  const char* model;  // configs/models/<model>.yaml
  int64_t text;       // S_Q ("8K" = 8192)
  int64_t frames;     // frame count; S_KV = frames x tokens per frame
  double ring_ca_s;   // measured cross-attention time per iteration, Ring Attention
  double lv_ca_s;     // measured cross-attention time per iteration, LV-XAttn
  double speedup;     // the paper's CA speedup column
};

// LV-XAttn Table 3: 16 A100 80GB (4 nodes x 4, NVLink inside, 25 GB/s between nodes).
const std::vector<PaperRow> kTable3 = {
    {"mplug_owl3_7b", 8192, 4096, 174.73, 24.08, 7.26},
    {"mplug_owl3_7b", 8192, 2048, 89.88, 12.14, 7.41},
    {"mplug_owl3_7b", 4096, 2048, 92.48, 6.45, 14.33},
    {"mplug_owl3_2b", 8192, 4096, 83.41, 10.33, 8.07},
    {"mplug_owl3_2b", 8192, 2048, 36.66, 5.21, 7.04},
    {"mplug_owl3_2b", 4096, 2048, 37.78, 2.79, 13.52},
    {"mplug_owl3_1b", 8192, 4096, 47.12, 5.17, 9.12},
    {"mplug_owl3_1b", 8192, 2048, 22.63, 2.62, 8.64},
    {"mplug_owl3_1b", 4096, 2048, 23.26, 1.52, 15.32},
    {"openflamingo_9b", 65536, 65536, 95.13, 62.4, 1.52},
    {"openflamingo_9b", 65536, 32768, 47.86, 31.44, 1.52},
    {"openflamingo_9b", 32768, 32768, 33.58, 16.0, 2.1},
    {"openflamingo_3b", 65536, 65536, 276.69, 187.45, 1.48},
    {"openflamingo_3b", 65536, 32768, 138.05, 94.1, 1.47},
    {"openflamingo_3b", 32768, 32768, 102.82, 47.98, 2.14},
};

// LV-XAttn Table 4: 8 A30 24GB (8 nodes x 1, 1.25 GB/s between nodes).
const std::vector<PaperRow> kTable4 = {
    {"mplug_owl3_7b", 1024, 512, 42.41, 1.42, 29.96},
    {"mplug_owl3_7b", 1024, 256, 20.81, 0.66, 31.31},
    {"mplug_owl3_7b", 512, 256, 20.84, 0.45, 45.85},
    {"mplug_owl3_2b", 1024, 512, 17.85, 0.78, 22.89},
    {"mplug_owl3_2b", 1024, 256, 9.06, 0.44, 20.6},
    {"mplug_owl3_2b", 512, 256, 9.15, 0.3, 30.39},
    {"mplug_owl3_1b", 1024, 512, 10.6, 0.44, 24.25},
    {"mplug_owl3_1b", 1024, 256, 5.38, 0.25, 21.19},
    {"mplug_owl3_1b", 512, 256, 5.31, 0.18, 29.44},
    {"openflamingo_9b", 8192, 8192, 17.28, 3.99, 4.33},
    {"openflamingo_9b", 8192, 4096, 8.74, 2.2, 3.97},
    {"openflamingo_9b", 4096, 4096, 8.87, 1.23, 7.2},
    {"openflamingo_3b", 8192, 8192, 52.26, 12.25, 4.27},
    {"openflamingo_3b", 8192, 4096, 26.09, 6.43, 4.06},
    {"openflamingo_3b", 4096, 4096, 25.84, 3.62, 7.14},
};

// paper_accounting() (cost_model.h): the paper's Ring Attention moves K/V with all query heads,
// its kernels compute masked attention densely, and its ring is one flat ring over every GPU;
// `lvx plan --paper-accounting` sets the same (tests/test_planner_cli.cpp).

// `strategies`: the candidates (empty: all six).
Plan plan_row(const PaperRow& r, const ClusterConfig& c,
              std::vector<StrategyKind> strategies = {}) {
  ModelConfig m = load_model_config(source(std::string("configs/models/") + r.model + ".yaml"));
  Workload w;
  w.frames = r.frames;
  w.text_tokens = r.text;
  w.train = true;
  w.strategies = std::move(strategies);
  return plan(m, c, w, paper_accounting());
}

struct CrossTimes {
  double ring = 0, lv = 0;
};
CrossTimes cross_times(const Plan& p) {
  return {uniform_time(p, StrategyKind::kRing, LayerKind::kCross),
          uniform_time(p, StrategyKind::kLvXAttn, LayerKind::kCross)};
}

double bisect(double lo, double hi, const std::function<double(double)>& decreasing,
              double target) {
  for (int i = 0; i < 200; ++i) {
    double mid = std::sqrt(lo * hi);
    (decreasing(mid) > target ? lo : hi) = mid;
  }
  return std::sqrt(lo * hi);
}

// Re-derives the paper cluster's attention throughput (from LV-XAttn's CA time) and inter-node
// bandwidth (from Ring Attention's CA time) on the reference row, and checks the YAML holds them.
void check_derivation(const std::string& yaml, const PaperRow& ref) {
  ClusterConfig c = load_cluster_config(source(yaml));
  const double bwd_ratio =
      c.attention.at("bf16").backward_flops / c.attention.at("bf16").forward_flops;
  ClusterConfig t = c;
  double f = bisect(
      1e11, 1e16,
      [&](double x) {
        t.attention["bf16"] = {x, x * bwd_ratio};
        return cross_times(plan_row(ref, t)).lv;
      },
      ref.lv_ca_s);
  t.attention["bf16"] = {f, f * bwd_ratio};
  double bw = bisect(
      1e7, 1e12,
      [&](double x) {
        t.inter_node.bandwidth_bytes_per_s = x;
        if (t.gpus_per_node == 1) t.intra_node.bandwidth_bytes_per_s = x;
        return cross_times(plan_row(ref, t)).ring;
      },
      ref.ring_ca_s);
  std::printf("%s: derived attention forward %.3f TFLOP/s, inter-node %.3f GB/s\n", yaml.c_str(),
              f / 1e12, bw / 1e9);
  EXPECT_NEAR(c.attention.at("bf16").forward_flops / f, 1.0, 0.01) << yaml;
  EXPECT_NEAR(c.inter_node.bandwidth_bytes_per_s / bw, 1.0, 0.01) << yaml;
}

TEST(PlannerPaper, PaperClustersAreDerivedFromOneRowEach) {
  check_derivation("configs/clusters/paper_a100_80g_16.yaml", kTable3[3]);
  check_derivation("configs/clusters/paper_a30_24g_8.yaml", kTable4[3]);
}

void check_table(const std::vector<PaperRow>& rows, const std::string& yaml) {
  ClusterConfig c = load_cluster_config(source(yaml));
  for (const PaperRow& r : rows) {
    SCOPED_TRACE(std::string(r.model) + " text " + std::to_string(r.text) + " frames " +
                 std::to_string(r.frames) + " on " + yaml);
    // Among the strategies the paper ran (LV-XAttn, Ring Attention and its striped variant), the
    // planner reproduces the paper's configuration: LV-XAttn for every cross layer, ring or
    // striped in the forward of every self layer (the backward may rotate the query side).
    Plan paper =
        plan_row(r, c, {StrategyKind::kLvXAttn, StrategyKind::kRing, StrategyKind::kStriped});
    for (const LayerPlan& l : paper.layers) {
      if (l.work.kind == LayerKind::kCross) {
        EXPECT_EQ(l.choice_name(), "lv_xattn") << "layer " << l.index << ": " << l.explanation;
      } else {
        EXPECT_TRUE(l.forward == StrategyKind::kRing || l.forward == StrategyKind::kStriped)
            << "layer " << l.index << ": " << l.explanation;
      }
    }
    // With every strategy, cross layers still take LV-XAttn; self layers may find something
    // faster than the paper's ring (docs/planner.md: ulysses where the heads split, all_gather
    // or local for short text), never slower.
    Plan p = plan_row(r, c);
    for (const LayerPlan& l : p.layers) {
      if (l.work.kind == LayerKind::kCross) {
        EXPECT_EQ(l.choice_name(), "lv_xattn") << "layer " << l.index << ": " << l.explanation;
      } else {
        const LayerPlan& lp = paper.layers[static_cast<size_t>(l.index)];
        EXPECT_LE(l.time_s, lp.time_s * (1 + 1e-12)) << "layer " << l.index;
      }
    }
    CrossTimes t = cross_times(p);
    const double predicted = t.ring / t.lv;
    std::printf(
        "%-16s text %6lld frames %6lld: predicted CA speedup %6.2f, measured %6.2f (%.2fx)\n",
        r.model, static_cast<long long>(r.text), static_cast<long long>(r.frames), predicted,
        r.speedup, predicted / r.speedup);
    EXPECT_GT(predicted, r.speedup / 2);
    EXPECT_LT(predicted, r.speedup * 2);
  }
}

TEST(PlannerPaper, Table3SpeedupsWithinTwoX) {
  check_table(kTable3, "configs/clusters/paper_a100_80g_16.yaml");
}

TEST(PlannerPaper, Table4SpeedupsWithinTwoX) {
  check_table(kTable4, "configs/clusters/paper_a30_24g_8.yaml");
}

// Table 3's caption: as S_Q doubles the CA speedup nearly halves (Ring Attention is
// communication-bound and stays, LV-XAttn is compute-bound and doubles); as S_KV doubles both
// double and the speedup holds. Rows come in triples: (2S_Q, 2F), (2S_Q, F), (S_Q, F).
void check_trends(const std::vector<PaperRow>& rows, const std::string& yaml) {
  ClusterConfig c = load_cluster_config(source(yaml));
  for (size_t i = 0; i + 2 < rows.size(); i += 3) {
    SCOPED_TRACE(std::string(rows[i].model) + " on " + yaml);
    CrossTimes big = cross_times(plan_row(rows[i], c));
    CrossTimes mid = cross_times(plan_row(rows[i + 1], c));
    CrossTimes small = cross_times(plan_row(rows[i + 2], c));
    const double s_big = big.ring / big.lv, s_mid = mid.ring / mid.lv,
                 s_small = small.ring / small.lv;
    // Halving S_Q (same frames): speedup roughly doubles.
    EXPECT_NEAR(s_small / s_mid, 2.0, 0.3);
    // Doubling S_KV (same S_Q): speedup roughly holds.
    EXPECT_NEAR(s_big / s_mid, 1.0, 0.15);
    // And the same trends are in the measurements, within the factor the model is held to.
    const double m_ratio = rows[i + 2].speedup / rows[i + 1].speedup;
    EXPECT_GT(s_small / s_mid, m_ratio / 2);
    EXPECT_LT(s_small / s_mid, m_ratio * 2);
  }
}

TEST(PlannerPaper, Table3Trends) {
  check_trends(kTable3, "configs/clusters/paper_a100_80g_16.yaml");
}
TEST(PlannerPaper, Table4Trends) { check_trends(kTable4, "configs/clusters/paper_a30_24g_8.yaml"); }

}  // namespace
}  // namespace lvx::planner
