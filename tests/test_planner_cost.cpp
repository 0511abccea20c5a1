// Cost model: bytes against hand-computed numbers and the strategies' own schedules, topology,
// overlap (LV-XAttn eq. (1)-(2)), causal balance and per-rank imbalance, mask work counted from the
// prompt layout, memory and infeasibility. The planner's choice is in tests/test_planner_plan.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "src/planner/cost_model.h"
#include "src/planner/planner.h"
#include "tests/planner_test_util.h"

namespace lvx::planner {
namespace {

using testing::source;

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
  w.elem_bytes = 2;
  w.dtype = "bf16";
  return w;
}

LayerWorkload self_layer(int64_t s) {
  LayerWorkload w = cross_layer();
  w.kind = LayerKind::kSelf;
  w.sq = w.skv = s;
  w.mask = MaskRule::kCausal;
  w.visual_feature_dim = 0;
  return w;
}

TEST(PlannerCost, BytesAreHandComputedAndTheStrategiesOwn) {
  // cross_layer() on 8 ranks in bf16: 512 queries and 131072 keys per rank.
  //   |Q| = 512·16·128·2 = 2097152;  |O|₃₂ + |lse|₃₂ = 512·16·128·4 + 512·16·4 = 4227072
  //   |K| + |V| = 131072·4·128·2·2 = 268435456;  |dK|₃₂ + |dV|₃₂ = 2·131072·4·128·4 = 536870912
  //   lv_xattn fwd: 7·2097152 + 8·4227072 = 48496640
  //   lv_xattn bwd: 7·(2·2097152 + 2·512·16·4) + 8·512·16·128·4 = 63373312
  //   ring fwd: 7·268435456 = 1879048192;  bwd: 1879048192 + 8·536870912 = 6174015488
  const ClusterConfig c = toy_cluster();
  const LayerWorkload w = cross_layer();
  CostOptions opt;
  opt.train = true;
  opt.topology_aware_ring = false;  // the flat ring of the formulas above (double ring: below)
  const StrategyCost lv = estimate(StrategyKind::kLvXAttn, w, c, 8, opt);
  const StrategyCost ring = estimate(StrategyKind::kRing, w, c, 8, opt);
  EXPECT_EQ(lv.bytes_sent.forward, 48496640.0);
  EXPECT_EQ(lv.bytes_sent.backward, 63373312.0);
  EXPECT_EQ(ring.bytes_sent.forward, 1879048192.0);
  EXPECT_EQ(ring.bytes_sent.backward, 6174015488.0);
  // And every strategy's prediction is its runtime schedule's volume (busiest rank), the same
  // numbers tests/test_attention.cpp checks against measured byte counters.
  LayerWorkload u = cross_layer();
  u.sq = 4099;  // uneven shards
  u.skv = 1003;
  u.kv_heads = 8;
  for (bool topology : {false, true})
    for (StrategyKind s : attention::all_strategies()) {
      if (s == StrategyKind::kDistFlash) continue;  // causal self-attention only: below
      opt.topology_aware_ring = topology;
      attention::AttentionSpec spec = layer_spec(u, opt);
      spec.node_size = topology ? c.gpus_per_node : 0;
      const auto st = attention::make_strategy(s);
      int64_t fwd = 0, bwd = 0;
      for (int r = 0; r < 8; ++r) {
        fwd = std::max(fwd, st->analytic_bytes(spec, 8, r, at::kBFloat16, false).sent);
        bwd = std::max(bwd, st->analytic_bytes(spec, 8, r, at::kBFloat16, true).sent);
      }
      const StrategyCost e = estimate(s, u, c, 8, opt);
      EXPECT_EQ(e.bytes_sent.forward, double(fwd)) << attention::strategy_name(s);
      EXPECT_EQ(e.bytes_sent.backward, double(bwd)) << attention::strategy_name(s);
    }
}

// The double ring (2 nodes of 4): a block makes n − 1 = 7 hops as in the flat ring, but the
// accumulators of each node cycle go round the whole node (4 hops, the last one home) and then
// one inter-node hop per node: n + I = 10 accumulator hops instead of 8.
//   lv_xattn fwd: 7·|Q| + 10·(|O|₃₂ + |lse|₃₂) = 7·2097152 + 10·4227072 = 56950784
//   ring bwd:     7·(|K| + |V|) + 10·(|dK|₃₂ + |dV|₃₂) = 1879048192 + 5368709120 = 7247757312
TEST(PlannerCost, DoubleRingBytesAndTheLinkItCrosses) {
  const ClusterConfig c = toy_cluster();
  const LayerWorkload w = cross_layer();
  CostOptions opt;
  opt.train = true;
  EXPECT_EQ(estimate(StrategyKind::kLvXAttn, w, c, 8, opt).bytes_sent.forward, 56950784.0);
  EXPECT_EQ(estimate(StrategyKind::kRing, w, c, 8, opt).bytes_sent.backward, 7247757312.0);
  // Rank 0's forward K/V messages: 3 to rank 1 (intra) and 1 to rank 4 (the same local index
  // on the next node), which spans the 4 rounds of the node cycle.
  attention::AttentionSpec spec = layer_spec(w, opt);
  spec.node_size = 4;
  const auto sched =
      attention::make_strategy(StrategyKind::kRing)->schedule(spec, 8, 0, at::kBFloat16, false);
  int to1 = 0, to4 = 0;
  for (const auto& m : sched.messages) {
    if (m.peer == 1) {
      ++to1;
      EXPECT_EQ(m.span, 1);
    }
    if (m.peer == 4) {
      ++to4;
      EXPECT_EQ(m.span, 4);
      EXPECT_EQ(m.round, 0);
    }
  }
  EXPECT_EQ(to1, 6);  // 3 per node cycle, 2 cycles
  EXPECT_EQ(to4, 1);
}

// Communication-bound ring forward (tiny query block) on 2 nodes of 4: the flat ring waits on
// the inter-node link in each of its 7 rounds (one rank of each node crosses per round); the
// double ring does 3 intra-node rounds per node cycle and hides its inter-node hop behind the
// first cycle, the node's 4 ranks each sending their block over the node's one link at once
// (inter_node bandwidth is per node):
//   T = max(3·max(f, intra) + f, inter_4) + 3·max(f, intra) + f,  inter_4 = α + 4·|K/V| / β.
TEST(PlannerCost, DoubleRingPaysTheInterNodeLinkOncePerNodeCycle) {
  const ClusterConfig c = toy_cluster();
  LayerWorkload w = cross_layer();
  w.sq = 8;
  const int n = 8;
  const double kv = 2.0 * (double(1 << 20) / n) * 4 * 128 * 2;
  const double f = 4.0 * (8.0 / n) * (double(1 << 20) / n) * 16 * 128 / 100e12;
  const double intra = c.intra_node.latency_s + kv / c.intra_node.bandwidth_bytes_per_s;
  const double inter = c.inter_node.latency_s + kv / c.inter_node.bandwidth_bytes_per_s;
  const double inter4 = c.inter_node.latency_s + 4 * kv / c.inter_node.bandwidth_bytes_per_s;
  CostOptions opt;
  const double expect = std::max(3 * std::max(f, intra) + f, inter4) + 3 * std::max(f, intra) + f;
  const double got = estimate(StrategyKind::kRing, w, c, n, opt).fwd_s;
  EXPECT_NEAR(got / expect, 1.0, 1e-9);
  opt.topology_aware_ring = false;
  const double flat = estimate(StrategyKind::kRing, w, c, n, opt).fwd_s;
  EXPECT_NEAR(flat / ((n - 1) * inter + f), 1.0, 1e-9);
  // 10 GB/s between nodes, 100 GB/s inside: 4 blocks cross per node instead of 7.
  EXPECT_LT(got, flat * 0.7);
}

// distflash on causal self-attention, compute-bound, n = 8: the diagonal round, then 4 rounds of
// one full block pair each on the busiest rank; the contiguous ring's rank 7 computes its
// diagonal and 7 full blocks, one per round (and the rounds wait for it).
TEST(PlannerCost, DistFlashBalancesCausalWork) {
  ClusterConfig c = toy_cluster();
  c.intra_node.bandwidth_bytes_per_s = c.inter_node.bandwidth_bytes_per_s = 1e15;  // compute-bound
  c.intra_node.latency_s = c.inter_node.latency_s = 0;
  const LayerWorkload w = self_layer(1 << 16);
  const int n = 8;
  const double s = double(1 << 16) / n;
  const double block = 4 * s * s * 16 * 128 / 100e12;  // a full block pair
  const double diag = 4 * (s * (s + 1) / 2) * 16 * 128 / 100e12;
  CostOptions opt;
  EXPECT_NEAR(estimate(StrategyKind::kDistFlash, w, c, n, opt).fwd_s / (diag + 4 * block), 1.0,
              1e-9);
  EXPECT_NEAR(estimate(StrategyKind::kRing, w, c, n, opt).fwd_s / (diag + 7 * block), 1.0, 1e-9);
  // Not a causal self-attention layer: infeasible, saying why.
  const StrategyCost x = estimate(StrategyKind::kDistFlash, cross_layer(), c, n, opt);
  EXPECT_FALSE(x.feasible);
  EXPECT_NE(x.reason.find("causal self-attention"), std::string::npos) << x.reason;
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
  opt.topology_aware_ring = false;  // a flat ring (the double ring: below)
  for (int64_t n : {4, 8}) {
    const Link l = n > 4 ? c.inter_node : c.intra_node;
    const double kv = 2.0 * (double(1 << 20) / n) * 4 * 128 * 2;
    const double f = 4.0 * (8.0 / n) * (double(1 << 20) / n) * 16 * 128 / 100e12;
    const double expect = (n - 1) * (l.latency_s + kv / l.bandwidth_bytes_per_s) + f;
    EXPECT_NEAR(estimate(StrategyKind::kRing, w, c, n, opt).fwd_s / expect, 1.0, 1e-9) << n;
  }
}

TEST(PlannerCost, AllToAllSharesTheNodeLink) {
  const ClusterConfig c = toy_cluster();
  // 8 ranks: each sends 3 chunks inside its node and 4 off it; the 4 GPUs of a node share it.
  const double bytes = 8e6, chunk = bytes / 8;
  const double intra = 5e-6 + 3 * chunk / 100e9, inter = 20e-6 + 4 * 4 * chunk / 10e9;
  EXPECT_NEAR(all_to_all_time(c, 8, bytes * 7 / 8), std::max(intra, inter), 1e-12);
  EXPECT_NEAR(all_to_all_time(c, 4, bytes * 3 / 4), 5e-6 + 3 * (bytes / 4) / 100e9, 1e-12);
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
  CostOptions flat;
  flat.topology_aware_ring = false;  // eq. (1) is for a flat ring
  const StrategyCost cost = estimate(StrategyKind::kLvXAttn, w, c, n, flat);
  EXPECT_NEAR(cost.fwd_s / expect, 1.0, 1e-12);
  EXPECT_EQ(cost.bound, "compute");  // S_KV >> S_Q: the query side hides behind compute
  EXPECT_EQ(estimate(StrategyKind::kRing, w, c, n, flat).bound, "communication");
}

TEST(PlannerCost, StripedBalancesCausalWork) {
  ClusterConfig c = toy_cluster();
  c.inter_node = c.intra_node = {1e15, 0};  // make compute the whole story
  const LayerWorkload w = self_layer(32768);
  const int64_t n = 8;
  const StrategyCost ring = estimate(StrategyKind::kRing, w, c, n, CostOptions{});
  const StrategyCost striped = estimate(StrategyKind::kStriped, w, c, n, CostOptions{});
  // Contiguous: rounds wait for the busiest rank, which computes a full block in every round but
  // the first (the diagonal, b(b+1)/2 of b² pairs); striped: every round is a diagonal-like
  // block on every rank (Striped Attention §3). b = 32768/8 tokens per shard.
  const double b = 32768.0 / n, diag = (b + 1) / (2 * b);
  EXPECT_NEAR(ring.fwd_s / striped.fwd_s, (diag + (n - 1)) / (n * diag), 1e-9);
}

TEST(PlannerCost, MaskWorkIsCountedFromThePromptLayout) {
  const ClusterConfig c = toy_cluster();
  // 128 frames, 1024 text tokens. video_qa: the 128 image tokens first, then the question.
  //   OpenFlamingo (media_immediate): every token sees one frame → density 1/128.
  //   mPLUG-Owl3 (media_upto, images strictly before the token): token t < 128 sees t frames,
  //   the 896 question tokens all 128 → density (127/2 + 896)/1024 = 0.93701171875.
  //   interleaved (frame f's token at 8f), media_upto: token t sees ceil(t/8) frames → ≈ 1/2.
  Workload wl;
  wl.frames = 128;
  wl.text_tokens = 1024;
  ModelConfig of = load_model_config(source("configs/models/openflamingo_9b.yaml"));
  ModelConfig mp = load_model_config(source("configs/models/mplug_owl3_7b.yaml"));
  for (const LayerWorkload& lw : layer_workloads(of, wl)) {
    if (lw.kind == LayerKind::kCross) {
      EXPECT_DOUBLE_EQ(lw.density(), 1.0 / 128);
      EXPECT_EQ(lw.skv, 128 * 64);
      EXPECT_EQ(lw.sq, 1024);
    } else {
      EXPECT_EQ(lw.skv, 1024);
      EXPECT_DOUBLE_EQ(lw.density(), 1025.0 / 2048);  // causal: S(S+1)/2 of S²
    }
  }
  const LayerWorkload qa = layer_workloads(mp, wl)[1];
  ASSERT_EQ(qa.kind, LayerKind::kCross);
  EXPECT_DOUBLE_EQ(qa.density(), 0.93701171875);
  wl.layout = PromptLayout::kInterleaved;
  const LayerWorkload inter = layer_workloads(mp, wl)[1];
  // Σ_t ceil(t/8) over t < 1024, of 1024·128 pairs (per key token of a frame alike).
  double pairs = 0;
  for (int t = 0; t < 1024; ++t) pairs += (t + 7) / 8;
  EXPECT_DOUBLE_EQ(inter.density(), pairs / (1024.0 * 128));
  // Compute scales with the counted pairs (one rank: no communication), and the papers' dense
  // accounting ignores the mask.
  CostOptions opt;
  LayerWorkload dense = qa;
  dense.mask = MaskRule::kNone;
  dense.pairs = nullptr;
  const double t_dense = estimate(StrategyKind::kLvXAttn, dense, c, 1, opt).fwd_compute_s;
  EXPECT_NEAR(estimate(StrategyKind::kLvXAttn, qa, c, 1, opt).fwd_compute_s / t_dense,
              0.93701171875, 1e-12);
  opt.skip_masked_tiles = false;
  EXPECT_NEAR(estimate(StrategyKind::kLvXAttn, inter, c, 1, opt).fwd_compute_s / t_dense, 1.0,
              1e-12);
}

TEST(PlannerCost, PerRankImbalanceIsInThePrediction) {
  // media_upto on 8 ranks. Interleaved frames, contiguous text: the last text shard sees almost
  // every frame and the first almost none, so ring, which keeps the queries in place, waits for
  // a busiest rank with about (1 − 1/16)/(1/2) = 1.875x the average work. lv_xattn keeps the keys
  // in place, and they are whole frames striped across the ranks (models::media_layout): every
  // rank's frames are seen by about as many queries, so it is balanced (were the frames split
  // contiguously, the first key shard would be seen by almost every query: 1.875x too). With
  // every frame before the question (video QA) the work is spread evenly either way: the busiest
  // rank does at most 1/density ≈ 1.07x the average.
  ClusterConfig c = toy_cluster();
  c.inter_node = c.intra_node = {1e15, 0};  // compute only
  ModelConfig mp = load_model_config(source("configs/models/mplug_owl3_7b.yaml"));
  Workload wl;
  wl.frames = 256;
  wl.text_tokens = 8192;
  for (PromptLayout layout : {PromptLayout::kInterleaved, PromptLayout::kVideoQA}) {
    wl.layout = layout;
    const LayerWorkload w = layer_workloads(mp, wl)[1];
    const double flops = 4.0 * w.heads * w.head_dim / 100e12;
    const double average = double(w.counter().total()) / 8 * flops;  // a balanced share
    for (StrategyKind s : {StrategyKind::kRing, StrategyKind::kLvXAttn}) {
      const double busiest = estimate(s, w, c, 8, CostOptions{}).fwd_compute_s;
      if (layout == PromptLayout::kInterleaved && s == StrategyKind::kRing)
        EXPECT_NEAR(busiest / average, 1.875, 0.01) << attention::strategy_name(s);
      else
        EXPECT_NEAR(busiest / average, 1.0, 0.08) << attention::strategy_name(s);
    }
  }
}

TEST(PlannerCost, HeadsThatDoNotSplitMakeUlyssesInfeasible) {
  const ClusterConfig c = toy_cluster();
  LayerWorkload w = cross_layer();
  w.heads = 28;
  w.kv_heads = 4;
  StrategyCost u = estimate(StrategyKind::kUlysses, w, c, 8, CostOptions{});
  EXPECT_FALSE(u.feasible);
  EXPECT_NE(u.reason.find("must both divide by the 8 ranks"), std::string::npos) << u.reason;
  w.heads = 32;
  w.kv_heads = 8;
  EXPECT_TRUE(estimate(StrategyKind::kUlysses, w, c, 8, CostOptions{}).feasible);
}

TEST(PlannerCost, MemoryLimitMakesAStrategyInfeasible) {
  ClusterConfig c = toy_cluster();
  c.device_memory_bytes = 8LL << 30;
  LayerWorkload w = cross_layer();
  w.skv = 16 << 20;  // full K/V = 16M x 4 x 128 x 2 x 2 B = 64 GiB
  CostOptions opt;
  StrategyCost ag = estimate(StrategyKind::kAllGather, w, c, 8, opt);
  EXPECT_FALSE(ag.feasible);
  EXPECT_NE(ag.reason.find("GiB"), std::string::npos) << ag.reason;
  EXPECT_TRUE(estimate(StrategyKind::kLvXAttn, w, c, 8, opt).feasible);  // 1/8 of K/V: 4 GiB
}

TEST(PlannerCost, RecomputationSavesOnlyXOutputAndLse) {
  const ClusterConfig c = toy_cluster();
  const LayerWorkload w = cross_layer();
  CostOptions opt;
  opt.train = true;
  const int64_t n = 8;
  const ShardBytes b = shard_bytes(w, n, opt);
  EXPECT_DOUBLE_EQ(estimate(StrategyKind::kLvXAttn, w, c, n, opt).saved_bytes, b.x + b.o + b.lse);
  opt.recompute_cross_kv = false;
  // Without it: q, K, V, O, lse and the K/V projection's input (normalized visual features).
  EXPECT_DOUBLE_EQ(estimate(StrategyKind::kLvXAttn, w, c, n, opt).saved_bytes,
                   b.q + b.k + b.v + b.o + b.lse + b.y);
  // Inference saves nothing and has no backward.
  StrategyCost inf = estimate(StrategyKind::kLvXAttn, w, c, n, CostOptions{});
  EXPECT_EQ(inf.saved_bytes, 0);
  EXPECT_EQ(inf.bwd_s, 0);
}

}  // namespace
}  // namespace lvx::planner
