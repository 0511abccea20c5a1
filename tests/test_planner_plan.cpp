// The planner (src/planner/planner.h) on shipped models and clusters: the fastest feasible choice
// per layer with its explanation and JSON, cross layers priced on the plan's text layout, split
// passes, trading time for memory so the whole plan fits, and bad workloads named.
#include <gtest/gtest.h>

#include <string>

#include "src/common/error.h"
#include "src/planner/cost_model.h"
#include "src/planner/planner.h"
#include "tests/planner_test_util.h"

namespace lvx::planner {
namespace {

using testing::source;

TEST(PlannerCost, PlannerChoosesExplainsAndWritesJson) {
  ModelConfig m = load_model_config(source("configs/models/mplug_owl3_7b.yaml"));
  ClusterConfig c = load_cluster_config(source("configs/clusters/a100_80g_16.yaml"));
  Workload w;
  w.frames = 2048;
  w.text_tokens = 4096;
  w.train = true;
  Plan p = plan(m, c, w);
  ASSERT_EQ(p.layers.size(), m.layers.size());
  for (const LayerPlan& l : p.layers) {
    // The choice is the fastest feasible candidate: no feasible strategy beats it.
    for (const auto& [s, cost] : l.costs) {
      if (cost.feasible) {
        EXPECT_LE(l.time_s, cost.fwd_s + cost.bwd_s + 1e-15) << attention::strategy_name(s);
      }
    }
    EXPECT_FALSE(l.explanation.empty());
    EXPECT_FALSE(l.costs.at(StrategyKind::kUlysses).feasible);  // 28 heads on 16 ranks
    if (l.work.kind == LayerKind::kCross) {
      EXPECT_EQ(l.choice_name(), "lv_xattn");
    }
  }
  nlohmann::json j = to_json(p);
  ASSERT_EQ(j["layers"].size(), m.layers.size());
  const auto& l1 = j["layers"][1];
  EXPECT_EQ(l1["index"], 1);
  EXPECT_EQ(l1["kind"], "cross");
  EXPECT_EQ(l1["choice"], "lv_xattn");
  for (const char* s : {"lv_xattn", "ring", "striped", "ulysses", "all_gather"}) {
    ASSERT_TRUE(l1["predicted"].contains(s)) << s;
    for (const char* k : {"fwd_s", "bwd_s", "mem_bytes", "feasible", "reason"}) {
      EXPECT_TRUE(l1["predicted"][s].contains(k)) << s << "." << k;
    }
  }
  EXPECT_FALSE(l1["predicted"]["ulysses"]["feasible"].get<bool>());
  EXPECT_GT(j["total"]["time_s"].get<double>(), 0);
  // Restricting the candidates is honoured.
  w.strategies = {StrategyKind::kRing};
  for (const LayerPlan& l : plan(m, c, w).layers) EXPECT_EQ(l.choice_name(), "ring");
}

// The text is sharded once for every layer, striped when a self layer runs striped
// (models::resolve_layouts), and a cross layer's queries are that text: the plan prices its cross
// layers on the text layout it chose. mPLUG-Owl3-7B, 4,096 frames, 8K text on 16 A100s: the self
// layers run striped, so lv_xattn's (and ring's) query blocks are striped, balanced.
TEST(PlannerCost, CrossLayersArePricedOnThePlansTextLayout) {
  ModelConfig m = load_model_config(source("configs/models/mplug_owl3_7b.yaml"));
  ClusterConfig c = load_cluster_config(source("configs/clusters/a100_80g_16.yaml"));
  Workload w;
  w.frames = 4096;
  w.text_tokens = 8192;
  w.train = true;
  const Plan p = plan(m, c, w);
  EXPECT_EQ(p.layers[0].choice_name(), "striped") << p.layers[0].explanation;
  EXPECT_EQ(p.options.text_layout, attention::LayoutKind::kStriped);
  EXPECT_EQ(to_json(p)["text_layout"], "striped");
  const LayerPlan& cross = p.layers[1];
  ASSERT_EQ(cross.work.kind, LayerKind::kCross);
  EXPECT_EQ(layer_spec(cross.work, c, p.options).q_layout, attention::LayoutKind::kStriped);
  const StrategyCost& lv = cross.costs.at(StrategyKind::kLvXAttn);
  const StrategyCost& striped = cross.costs.at(StrategyKind::kStriped);
  const StrategyCost& ring = cross.costs.at(StrategyKind::kRing);
  // lv_xattn moves the queries and fp32 outputs: 0.46 GB per rank, against striped's 26.8 GB.
  EXPECT_EQ(lv.bytes_sent.forward, 202997760.0);
  EXPECT_EQ(lv.bytes_sent.backward, 258621440.0);
  EXPECT_EQ(striped.bytes_sent.forward + striped.bytes_sent.backward, 26754416640.0);
  // On striped text, ring and striped run the same (striped on a cross layer is ring over the
  // striped text; the keys are striped whole frames either way).
  EXPECT_NEAR(ring.fwd_compute_s + ring.bwd_compute_s,
              striped.fwd_compute_s + striped.bwd_compute_s, 1e-9);
  CostOptions contiguous = p.options;
  contiguous.text_layout = attention::LayoutKind::kContiguous;
  const StrategyCost lv_contiguous =
      estimate(StrategyKind::kLvXAttn, cross.work, c, 16, contiguous);
  EXPECT_LE(lv.fwd_s + lv.bwd_s, lv_contiguous.fwd_s + lv_contiguous.bwd_s * 1.0001);
  EXPECT_EQ(lv.bytes_sent.forward, lv_contiguous.bytes_sent.forward);
  // Under mPLUG-Owl3's media_upto rule with the frames first, frame f is seen by 8192 − f text
  // tokens. Split contiguously, rank 0's frames were seen by nearly every token and rank 15's by
  // about half, and lv_xattn's busiest rank did 1.31x the mean; striped by frame (the runtime's
  // layout) each rank's frames are seen alike, lv_xattn computes what ring does, sends 57x
  // fewer bytes, and is chosen.
  EXPECT_NEAR(
      (lv.fwd_compute_s + lv.bwd_compute_s) / (striped.fwd_compute_s + striped.bwd_compute_s), 1.0,
      0.01);
  EXPECT_EQ(cross.choice_name(), "lv_xattn") << cross.explanation;
  attention::AttentionSpec spec = layer_spec(cross.work, c, p.options);
  EXPECT_EQ(spec.kv_layout, attention::LayoutKind::kStriped);
  EXPECT_EQ(spec.kv_unit, m.visual_tokens_per_frame);
}

TEST(PlannerCost, ForwardAndBackwardMayDiffer) {
  // Self-attention with K/V expanded to all heads: the backward of ring rotates K, V and fp32
  // dK, dV, while the query-side rotation moves Q, dO, lse, delta and fp32 dQ: the planner
  // splits the pass where both keep the same saved shards.
  ModelConfig m = load_model_config(source("configs/models/mplug_owl3_7b.yaml"));
  ClusterConfig c = load_cluster_config(source("configs/clusters/a100_80g_16.yaml"));
  Workload w;
  w.frames = 4096;
  w.text_tokens = 8192;
  w.train = true;
  w.strategies = {StrategyKind::kRing, StrategyKind::kLvXAttn};
  CostOptions opt;
  opt.expand_kv_heads = true;
  Plan p = plan(m, c, w, opt);
  const LayerPlan& self = p.layers[0];
  EXPECT_EQ(self.choice_name(), "ring+lv_xattn") << self.explanation;
  EXPECT_NEAR(
      self.time_s,
      self.costs.at(StrategyKind::kRing).fwd_s + self.costs.at(StrategyKind::kLvXAttn).bwd_s,
      1e-15);
}

TEST(PlannerCost, BadWorkloadsAreNamed) {
  ModelConfig m = load_model_config(source("configs/models/tiny.yaml"));
  ClusterConfig c = load_cluster_config(source("configs/clusters/a100_80g_16.yaml"));
  Workload w;
  w.frames = 8;
  w.text_tokens = 4;
  EXPECT_THROW(
      {
        try {
          plan(m, c, w);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("--text"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
  w.text_tokens = 64;
  w.ranks = 32;
  EXPECT_THROW(plan(m, c, w), Error);
  w.ranks = 0;
  c.attention.erase("fp32");  // tiny runs in fp32
  EXPECT_THROW(plan(m, c, w), Error);
}

TEST(PlannerCost, WholePlanMemoryTradesTimeForSavedActivations) {
  // mPLUG-Owl3-7b, 4K text on 8 A30 over 1.25 GB/s: the self layers prefer all_gather (one
  // reduce-scatter of dK/dV instead of n-1 rounds of K/V plus fp32 dK/dV), which keeps the
  // gathered K/V until the backward. With less memory left for attention, the planner moves the
  // cheapest layers to a ring-family strategy until the whole plan fits, and says so.
  ModelConfig m = load_model_config(source("configs/models/mplug_owl3_7b.yaml"));
  ClusterConfig c = load_cluster_config(source("configs/clusters/a30_24g_8.yaml"));
  Workload w;
  w.frames = 2048;
  w.text_tokens = 4096;
  w.train = true;
  Plan free_plan = plan(m, c, w);
  ASSERT_TRUE(free_plan.fits);
  ASSERT_EQ(free_plan.layers[0].choice_name(), "all_gather") << free_plan.layers[0].explanation;
  // What moving every self layer from all_gather to ring would free.
  double freeable = 0;
  for (const LayerPlan& l : free_plan.layers) {
    if (l.work.kind == LayerKind::kSelf) {
      freeable += l.costs.at(StrategyKind::kAllGather).saved_bytes -
                  l.costs.at(StrategyKind::kRing).saved_bytes;
    }
  }
  ASSERT_GT(freeable, 0);
  CostOptions tight;
  tight.reserved_bytes = double(c.device_memory_bytes) - (free_plan.peak_mem_bytes - freeable / 2);
  Plan p = plan(m, c, w, tight);
  EXPECT_TRUE(p.fits);
  EXPECT_LE(p.peak_mem_bytes, double(c.device_memory_bytes) - tight.reserved_bytes);
  EXPECT_GT(p.total_s, free_plan.total_s);  // memory was bought with time
  int switched = 0;
  for (const LayerPlan& l : p.layers) {
    if (l.explanation.find("to fit the whole plan in memory") != std::string::npos) ++switched;
  }
  EXPECT_GT(switched, 0);
  EXPECT_LT(switched, 28);  // only as many as needed
  // Nothing can free enough: the plan says it does not fit.
  tight.reserved_bytes =
      double(c.device_memory_bytes) - (free_plan.peak_mem_bytes - freeable * 1.5);
  EXPECT_FALSE(plan(m, c, w, tight).fits);
}

}  // namespace
}  // namespace lvx::planner
