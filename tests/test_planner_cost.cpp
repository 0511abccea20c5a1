// Cost model and planner: communication volumes against the formulas written out independently
// here, topology, overlap (LV-XAttn eq. (1)-(2)), causal balance, masks, memory, infeasibility,
// and the planner's choice and JSON.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "src/common/error.h"
#include "src/planner/cost_model.h"
#include "src/planner/planner.h"

namespace lvx::planner {
namespace {

std::string source(const std::string& rel) { return std::string(LVX_SOURCE_DIR) + "/" + rel; }

// 2 nodes x 4 GPUs; simple numbers so expected times are easy to write down.
ClusterConfig toy_cluster() {
  ClusterConfig c;
  c.name = "toy";
  c.device = "toy";
  c.gpus_per_node = 4;
  c.nodes = 2;
  c.device_memory_bytes = 80LL << 30;
  c.attention["bf16"] = {100e12, 50e12};
  c.gemm_flops["bf16"] = 200e12;
  c.intra_node = {100e9, 5e-6};
  c.inter_node = {10e9, 20e-6};
  return c;
}

LayerWorkload cross_layer() {
  LayerWorkload w;
  w.kind = LayerKind::kCross;
  w.sq = 4096;
  w.skv = 1 << 20;
  w.heads = 16;
  w.kv_heads = 4;
  w.head_dim = 128;
  w.hidden_size = 2048;
  w.visual_feature_dim = 1024;
  w.mask = MaskRule::kNone;
  w.density = 1;
  w.elem_bytes = 2;
  w.dtype = "bf16";
  return w;
}

LayerWorkload self_layer(int64_t s) {
  LayerWorkload w = cross_layer();
  w.kind = LayerKind::kSelf;
  w.sq = w.skv = s;
  w.mask = MaskRule::kCausal;
  w.density = 0.5;
  w.visual_feature_dim = 0;
  return w;
}

TEST(PlannerCost, VolumesMatchTheStrategyFormulas) {
  const ClusterConfig c = toy_cluster();
  CostOptions opt;
  opt.train = true;
  const LayerWorkload w = cross_layer();
  for (int64_t n : {2, 4, 8}) {
    SCOPED_TRACE(n);
    // Written out from the strategy definitions (bytes per rank; fp32 partials and gradients).
    const double sq = 4096.0 / n, skv = double(1 << 20) / n;
    const double Q = sq * 16 * 128 * 2, K = skv * 4 * 128 * 2, V = K, O = Q;
    const double O32 = sq * 16 * 128 * 4, lse = sq * 16 * 4, dQ32 = O32, dK32 = skv * 4 * 128 * 4;
    const double m = double(n - 1);
    auto vol = [&](Strategy s) { return estimate(s, w, c, n, opt).bytes_sent; };
    EXPECT_DOUBLE_EQ(vol(Strategy::kLvXattn).forward, m * Q + n * (O32 + lse));
    EXPECT_DOUBLE_EQ(vol(Strategy::kLvXattn).backward, m * (Q + Q + lse + lse) + n * dQ32);
    EXPECT_DOUBLE_EQ(vol(Strategy::kRing).forward, m * (K + V));
    EXPECT_DOUBLE_EQ(vol(Strategy::kRing).backward, m * (K + V) + n * 2 * dK32);
    EXPECT_DOUBLE_EQ(vol(Strategy::kStriped).backward, vol(Strategy::kRing).backward);
    EXPECT_DOUBLE_EQ(vol(Strategy::kUlysses).forward, m / n * (Q + K + V + O + lse));
    EXPECT_DOUBLE_EQ(vol(Strategy::kUlysses).backward, m / n * (Q + Q + K + V));
    EXPECT_DOUBLE_EQ(vol(Strategy::kAllGather).forward, m * (K + V));
    EXPECT_DOUBLE_EQ(vol(Strategy::kAllGather).backward, m / n * (n * dK32 + n * dK32));
  }
}

TEST(PlannerCost, GqaMovesKvHeadsOnlyUnlessExpanded) {
  const ClusterConfig c = toy_cluster();
  CostOptions opt;
  LayerWorkload w = cross_layer();
  const double gqa = estimate(Strategy::kRing, w, c, 8, opt).bytes_sent.forward;
  opt.expand_kv_heads = true;
  const double expanded = estimate(Strategy::kRing, w, c, 8, opt).bytes_sent.forward;
  EXPECT_DOUBLE_EQ(expanded / gqa, 16.0 / 4.0);
  // LV-XAttn moves only the query side: unchanged by the K/V heads.
  EXPECT_DOUBLE_EQ(estimate(Strategy::kLvXattn, w, c, 8, opt).bytes_sent.forward,
                   estimate(Strategy::kLvXattn, w, c, 8, CostOptions{}).bytes_sent.forward);
}

TEST(PlannerCost, RingCrossingNodesPaysTheInterNodeLink) {
  const ClusterConfig c = toy_cluster();
  EXPECT_EQ(ring_link(c, 4).bandwidth_bytes_per_s, 100e9);  // one node: NVLink-class
  EXPECT_EQ(ring_link(c, 8).bandwidth_bytes_per_s, 10e9);   // two nodes: some hop crosses
  // Communication-bound ring forward (tiny query block): (n-1) rounds of comm(|K|+|V|) on the
  // slowest hop plus the last round's compute, eq. (2) summed over rounds.
  LayerWorkload w = cross_layer();
  w.sq = 8;
  CostOptions opt;
  for (int64_t n : {4, 8}) {
    const Link l = n > 4 ? c.inter_node : c.intra_node;
    const double kv = 2.0 * (double(1 << 20) / n) * 4 * 128 * 2;
    const double f = 4.0 * (8.0 / n) * (double(1 << 20) / n) * 16 * 128 / 100e12;
    const double expect = (n - 1) * (l.latency_s + kv / l.bandwidth_bytes_per_s) + f;
    EXPECT_NEAR(estimate(Strategy::kRing, w, c, n, opt).fwd_s / expect, 1.0, 1e-9) << n;
  }
}

TEST(PlannerCost, AllToAllSharesTheNodeLink) {
  const ClusterConfig c = toy_cluster();
  // 8 ranks: each sends 3 chunks inside its node and 4 off it; the 4 GPUs of a node share it.
  const double bytes = 8e6, chunk = bytes / 8;
  const double intra = 5e-6 + 3 * chunk / 100e9, inter = 20e-6 + 4 * 4 * chunk / 10e9;
  EXPECT_NEAR(all_to_all_time(c, 8, bytes), std::max(intra, inter), 1e-12);
  EXPECT_NEAR(all_to_all_time(c, 4, bytes), 5e-6 + 3 * (bytes / 4) / 100e9, 1e-12);
}

TEST(PlannerCost, LvXattnOverlapsAsInEquationOne) {
  const ClusterConfig c = toy_cluster();
  const LayerWorkload w = cross_layer();
  const int64_t n = 8;
  const double sq = 4096.0 / n, skv = double(1 << 20) / n;
  const double f = 4 * sq * skv * 16 * 128 / 100e12;
  auto comm = [&](double b) { return 20e-6 + b / 10e9; };
  const double Q = sq * 16 * 128 * 2, OL = sq * 16 * 128 * 4 + sq * 16 * 4;
  // Round 0 sends Q only, rounds 1..n-2 Q and the previous partial, round n-1 the partial only,
  // then the last partial goes home.
  const double expect =
      std::max(f, comm(Q)) + (n - 2) * std::max(f, comm(Q + OL)) + std::max(f, comm(OL)) + comm(OL);
  const StrategyCost cost = estimate(Strategy::kLvXattn, w, c, n, CostOptions{});
  EXPECT_NEAR(cost.fwd_s / expect, 1.0, 1e-12);
  EXPECT_EQ(cost.bound, "compute");  // S_KV >> S_Q: the query side hides behind compute
  EXPECT_EQ(estimate(Strategy::kRing, w, c, n, CostOptions{}).bound, "communication");
}

TEST(PlannerCost, StripedBalancesCausalWork) {
  ClusterConfig c = toy_cluster();
  c.inter_node = c.intra_node = {1e15, 0};  // make compute the whole story
  const LayerWorkload w = self_layer(32768);
  const int64_t n = 8;
  const StrategyCost ring = estimate(Strategy::kRing, w, c, n, CostOptions{});
  const StrategyCost striped = estimate(Strategy::kStriped, w, c, n, CostOptions{});
  // Contiguous: the last rank computes n - 1/2 blocks; striped: n/2 (Striped Attention §3).
  EXPECT_NEAR(ring.fwd_s / striped.fwd_s, (n - 0.5) / (n / 2.0), 1e-6);
}

TEST(PlannerCost, MediaMaskDensityScalesCompute) {
  const ClusterConfig c = toy_cluster();
  LayerWorkload w = cross_layer();
  const double dense = estimate(Strategy::kLocal, w, c, 1, CostOptions{}).fwd_compute_s;
  w.mask = MaskRule::kMediaImmediate;
  w.density = 1.0 / 64;
  EXPECT_NEAR(estimate(Strategy::kLocal, w, c, 1, CostOptions{}).fwd_compute_s * 64 / dense, 1.0,
              1e-12);
  CostOptions dense_opt;
  dense_opt.skip_masked_tiles = false;
  EXPECT_NEAR(estimate(Strategy::kLocal, w, c, 1, dense_opt).fwd_compute_s / dense, 1.0, 1e-12);
  // The planner's densities: causal 1/2, media_upto 1/2, media_immediate 1/frames.
  ModelConfig m = load_model_config(source("configs/models/openflamingo_9b.yaml"));
  Workload wl;
  wl.frames = 128;
  wl.text_tokens = 1024;
  for (const LayerWorkload& lw : layer_workloads(m, wl)) {
    if (lw.kind == LayerKind::kCross) {
      EXPECT_DOUBLE_EQ(lw.density, 1.0 / 128);
      EXPECT_EQ(lw.skv, 128 * 64);
      EXPECT_EQ(lw.sq, 1024);
    } else {
      EXPECT_EQ(lw.skv, 1024);
    }
  }
}

TEST(PlannerCost, HeadsThatDoNotSplitMakeUlyssesInfeasible) {
  const ClusterConfig c = toy_cluster();
  LayerWorkload w = cross_layer();
  w.heads = 28;
  w.kv_heads = 4;
  StrategyCost u = estimate(Strategy::kUlysses, w, c, 8, CostOptions{});
  EXPECT_FALSE(u.feasible);
  EXPECT_NE(u.reason.find("heads cannot be split"), std::string::npos) << u.reason;
  w.heads = 32;
  w.kv_heads = 8;
  EXPECT_TRUE(estimate(Strategy::kUlysses, w, c, 8, CostOptions{}).feasible);
}

TEST(PlannerCost, MemoryLimitMakesAStrategyInfeasible) {
  ClusterConfig c = toy_cluster();
  c.device_memory_bytes = 8LL << 30;
  LayerWorkload w = cross_layer();
  w.skv = 16 << 20;  // full K/V = 16M x 4 x 128 x 2 x 2 B = 64 GiB
  CostOptions opt;
  StrategyCost ag = estimate(Strategy::kAllGather, w, c, 8, opt);
  EXPECT_FALSE(ag.feasible);
  EXPECT_NE(ag.reason.find("GiB"), std::string::npos) << ag.reason;
  EXPECT_FALSE(estimate(Strategy::kLocal, w, c, 8, opt).feasible);
  EXPECT_TRUE(estimate(Strategy::kLvXattn, w, c, 8, opt).feasible);  // 1/8 of K/V: 4 GiB
}

TEST(PlannerCost, RecomputationSavesOnlyXOutputAndLse) {
  const ClusterConfig c = toy_cluster();
  const LayerWorkload w = cross_layer();
  CostOptions opt;
  opt.train = true;
  const int64_t n = 8;
  const ShardBytes b = shard_bytes(w, n, opt);
  EXPECT_DOUBLE_EQ(estimate(Strategy::kLvXattn, w, c, n, opt).saved_bytes, b.x + b.o + b.lse);
  opt.recompute_cross_kv = false;
  EXPECT_DOUBLE_EQ(estimate(Strategy::kLvXattn, w, c, n, opt).saved_bytes,
                   b.q + b.k + b.v + b.o + b.lse);
  // Inference saves nothing and has no backward.
  StrategyCost inf = estimate(Strategy::kLvXattn, w, c, n, CostOptions{});
  EXPECT_EQ(inf.saved_bytes, 0);
  EXPECT_EQ(inf.bwd_s, 0);
}

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
        EXPECT_LE(l.time_s, cost.fwd_s + cost.bwd_s + 1e-15) << to_string(s);
      }
    }
    EXPECT_FALSE(l.explanation.empty());
    EXPECT_FALSE(l.costs.at(Strategy::kUlysses).feasible);  // 28 heads on 16 ranks
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
  for (const char* s : {"lv_xattn", "ring", "striped", "ulysses", "all_gather", "local"}) {
    ASSERT_TRUE(l1["predicted"].contains(s)) << s;
    for (const char* k : {"fwd_s", "bwd_s", "mem_bytes", "feasible", "reason"}) {
      EXPECT_TRUE(l1["predicted"][s].contains(k)) << s << "." << k;
    }
  }
  EXPECT_FALSE(l1["predicted"]["ulysses"]["feasible"].get<bool>());
  EXPECT_GT(j["total"]["time_s"].get<double>(), 0);
  // Restricting the candidates is honoured.
  w.strategies = {Strategy::kRing};
  for (const LayerPlan& l : plan(m, c, w).layers) EXPECT_EQ(l.choice_name(), "ring");
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
  w.strategies = {Strategy::kRing, Strategy::kLvXattn};
  CostOptions opt;
  opt.expand_kv_heads = true;
  Plan p = plan(m, c, w, opt);
  const LayerPlan& self = p.layers[0];
  EXPECT_EQ(self.choice_name(), "ring+lv_xattn") << self.explanation;
  EXPECT_NEAR(self.time_s,
              self.costs.at(Strategy::kRing).fwd_s + self.costs.at(Strategy::kLvXattn).bwd_s,
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

}  // namespace
}  // namespace lvx::planner

#include "src/planner/calibrate.h"

namespace lvx::planner {
namespace {

TEST(PlannerCalibrate, FitLinkRecoversLatencyAndBandwidth) {
  // comm(B) = 50 us + B / 2 GB/s, with one noisy small message.
  std::vector<int64_t> sizes = {8, 64, 512, 4096, 1 << 20, 16 << 20};
  std::vector<double> sec;
  for (int64_t b : sizes) sec.push_back(50e-6 + double(b) / 2e9);
  sec[1] += 3e-3;
  Link l = fit_link(sizes, sec);
  EXPECT_NEAR(l.latency_s, 50e-6, 1e-7);
  EXPECT_NEAR(l.bandwidth_bytes_per_s / 2e9, 1.0, 1e-9);
  EXPECT_THROW(fit_link({8, 64}, {1e-6, 2e-6}), Error);
}

}  // namespace
}  // namespace lvx::planner

namespace lvx::planner {
namespace {

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
      freeable +=
          l.costs.at(Strategy::kAllGather).saved_bytes - l.costs.at(Strategy::kRing).saved_bytes;
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
