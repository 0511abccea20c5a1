// lvx calibrate's fits (src/planner/calibrate.h): link latency and bandwidth, the kernel's per-call
// and per-tile costs and rate, and the calibrated cluster YAML's round trip into the cost model.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "src/common/error.h"
#include "src/planner/calibrate.h"
#include "src/planner/cost_model.h"

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
  EXPECT_NEAR(l.bandwidth_bytes_per_s / 2e9, 1.0, 1e-6);
  EXPECT_THROW(fit_link({8, 64}, {1e-6, 2e-6}), Error);
  // A shaped link (0.3 s for the largest message): noise of 20 % on the second largest sample
  // moves the slope by about as much; the largest message's own rate stays within 0.1 %.
  std::vector<int64_t> big = {8, 512, 32768, 262144, 2097152};
  std::vector<double> t;
  for (int64_t b : big) t.push_back(100e-6 + double(b) / 7e6);
  t[3] *= 1.2;
  Link s = fit_link(big, t);
  EXPECT_NEAR(s.bandwidth_bytes_per_s / 7e6, 1.0, 1e-3);
}

TEST(PlannerCalibrate, KernelCostFitRecoversCallTileAndRate) {
  // time = 300 us + T·8·100 us + 4·Sq·Sk·8·64 / 30 GFLOP/s, on calibrate's three shapes.
  auto t = [](int64_t sq, int64_t sk) {
    const double tiles = double((sq + 127) / 128) * double((sk + 511) / 512);
    return 300e-6 + tiles * 8 * 100e-6 + 4.0 * double(sq) * double(sk) * 8 * 64 / 30e9;
  };
  const KernelCostFit f = fit_kernel_cost(
      {{16, 16, t(16, 16)}, {16, 8192, t(16, 8192)}, {512, 512, t(512, 512)}}, 8, 64, 4);
  EXPECT_NEAR(f.call_s / 300e-6, 1.0, 1e-6);
  EXPECT_NEAR(f.tile_s / 100e-6, 1.0, 1e-6);
  EXPECT_NEAR(f.flops / 30e9, 1.0, 1e-6);
  // Noise that makes the rate negative keeps the largest sample's plain throughput only.
  const KernelCostFit bad =
      fit_kernel_cost({{16, 16, 1.0}, {16, 8192, 1e-3}, {512, 512, 1e-3}}, 8, 64, 4);
  EXPECT_EQ(bad.call_s, 0);
  EXPECT_NEAR(bad.flops, 4.0 * 512 * 512 * 8 * 64 / 1e-3, 1);
}

TEST(PlannerCalibrate, CallsAndTilesArePricedPerRoundAndTheConfigRoundTrips) {
  ClusterConfig c;
  c.name = "t";
  c.device = "cpu";
  c.gpus_per_node = 2;
  c.nodes = 1;
  c.device_memory_bytes = int64_t{1} << 34;
  AttentionThroughput a;
  a.forward_flops = 1e10;
  a.backward_flops = 1e10;
  a.forward_call_s = 1e-3;
  a.backward_call_s = 2e-3;
  a.forward_tile_s = 1e-4;
  a.backward_tile_s = 3e-4;
  a.forward_masked_tile_s = 5e-4;
  a.backward_masked_tile_s = 7e-4;
  c.attention["fp32"] = a;
  c.gemm_flops["fp32"] = 1e10;
  c.intra_node = c.inter_node = Link{1e15, 1e-12};
  // Round trip through the YAML lvx calibrate writes.
  const std::string path = (std::filesystem::temp_directory_path() / "lvx_test_cal.yaml").string();
  std::ofstream(path) << cluster_config_yaml(c, "test");
  const ClusterConfig back = load_cluster_config(path);
  const AttentionThroughput& b = back.attention.at("fp32");
  EXPECT_NEAR(b.forward_call_s, 1e-3, 1e-12);
  EXPECT_NEAR(b.backward_tile_s, 3e-4, 1e-12);
  EXPECT_NEAR(b.forward_masked_tile_s, 5e-4, 1e-12);
  // Causal self-attention, 1024 tokens, 8 heads of 64, on 1 rank (ring: the one block (0, 0)):
  // one call of 8 × 2 tiles of 128 × 512 per head.
  LayerWorkload w;
  w.kind = LayerKind::kSelf;
  w.sq = w.skv = 1024;
  w.heads = w.kv_heads = 8;
  w.head_dim = 64;
  w.mask = MaskRule::kCausal;
  w.elem_bytes = 4;
  w.dtype = "fp32";
  const attention::Layout l{attention::LayoutKind::kContiguous, 1024, 1};
  const PairCounter::Tiles tiles = w.counter().tiles(l, 0, l, 0);
  // q tile i (rows 128i..128i+127) against key tile j (512j..512j+511): full when
  // 512j + 511 ≤ 128i, empty when 512j > 128i + 127, else partial. i = 0..7, j = 0..1:
  // j = 0: partial for i = 0..3 (128i < 511), full for i = 4..7; j = 1: empty for i = 0..3,
  // partial for i = 4..7.
  EXPECT_EQ(tiles.full, 4);
  EXPECT_EQ(tiles.partial, 8);
  CostOptions opt;
  const double pairs = 1024.0 * 1025 / 2;
  const double expect = 1e-3 + 8 * (12 * 1e-4 + 8 * 5e-4) + 4 * pairs * 8 * 64 / 1e10;
  EXPECT_NEAR(estimate(StrategyKind::kRing, w, c, 1, opt).fwd_s / expect, 1.0, 1e-9);

  // Ranks sharing cores: every blocking collective waits Link::sync_s once (calibrate's
  // sync_us, which round-trips), overlapped ring hops do not. On 2 ranks ulysses' forward has 5
  // all-to-alls (Q, K, V to head shards; O and lse back), its backward 4 (dO; dQ, dK, dV);
  // all_gather's forward 2 ring all-gathers (K, V) and its backward one reduce-scatter
  // (pairwise, priced as an all-to-all); ring pays nothing.
  c.intra_node = c.inter_node = Link{1e15, 1e-12, 2e-3};
  std::ofstream(path) << cluster_config_yaml(c, "test");
  const ClusterConfig synced = load_cluster_config(path);
  EXPECT_NEAR(synced.intra_node.sync_s, 2e-3, 1e-12);
  ClusterConfig plain = synced;
  plain.intra_node.sync_s = plain.inter_node.sync_s = 0;
  opt.train = true;
  auto extra = [&](StrategyKind k, bool bwd) {
    const StrategyCost a = estimate(k, w, synced, 2, opt), b = estimate(k, w, plain, 2, opt);
    return bwd ? a.bwd_s - b.bwd_s : a.fwd_s - b.fwd_s;
  };
  EXPECT_NEAR(extra(StrategyKind::kUlysses, false), 5 * 2e-3, 1e-9);
  EXPECT_NEAR(extra(StrategyKind::kUlysses, true), 4 * 2e-3, 1e-9);
  EXPECT_NEAR(extra(StrategyKind::kAllGather, false), 2 * 2e-3, 1e-9);
  EXPECT_NEAR(extra(StrategyKind::kRing, false), 0, 1e-12);
  EXPECT_NEAR(extra(StrategyKind::kRing, true), 0, 1e-12);
}

}  // namespace
}  // namespace lvx::planner
