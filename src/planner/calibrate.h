// Measurements behind `lvx calibrate`: this machine's attention and matmul throughput per dtype
// (through kernels/attention.h and ATen), and the latency and bandwidth of a ring step between
// local ranks (through dist::ProcessGroup), turned into the figures of a cluster config.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "src/dist/process_group.h"
#include "src/planner/cluster_config.h"

namespace lvx::planner {

struct ThroughputSample {
  // Attention FLOP/s (FlashAttention convention, cost_model.h), per call, per tile and per partly
  // masked tile, as a cluster config holds them, in one rank's units.
  AttentionThroughput attention;
  double gemm_flops = 0;                 // dense matmul FLOP/s
  double forward_s = 0, backward_s = 0;  // median time of one s × s call
};

// The device's read bandwidth in bytes/s: the median of `reps` sums over a 512 MiB fp32 tensor
// (far beyond any cache) with `threads` intra-op threads (0: as they are) — what a decode step
// streaming its weights gets (src/planner/decode_price.h).
double measure_read_bandwidth(const at::Device& device, int reps, int threads);

// Times attention_forward / attention_backward on q [1, s, heads, d] against k, v of the same
// length (no mask, then causal over permuted positions, then 16 tokens) and a square matmul of
// size `gemm_n`, median of `reps` after a warm-up, with `threads` intra-op threads (the share of
// the cores each of the ranks gets), throughputs scaled by `share` (< 1 when more ranks than
// cores compute at once).
ThroughputSample measure_throughput(at::ScalarType dtype, const at::Device& device, int64_t s,
                                    int64_t heads, int64_t d, int64_t gemm_n, int reps,
                                    int threads = 0, double share = 1.0);

// The forward+backward time of one block of sq × skv on the CPU's fused and GEMM paths
// (kernels/cpu_path.h), for choosing per shape.
struct CpuPathSample {
  int64_t sq = 0, skv = 0;
  double fused_s = 0, gemm_s = 0;
};
// Times both paths at each (sq, skv) with `heads` heads of `d`, fp32, `threads` intra-op threads,
// median of `reps` after a warm-up. The process-wide choice is restored afterwards.
std::vector<CpuPathSample> measure_cpu_paths(const std::vector<std::pair<int64_t, int64_t>>& shapes,
                                             int64_t heads, int64_t d, int reps, int threads);
// Per measured aspect ratio, the faster path (ties to fused).
std::vector<CpuAttentionChoice> choose_cpu_paths(const std::vector<CpuPathSample>& samples);

// The per-call / per-tile / throughput model of a kernel call, time = c + T·H·t + k·Sq·Sk·H·d /
// rate (T: tiles of the CPU kernels' grid, k: 4 forward, 10 backward), fitted exactly to three
// samples (unmasked calls of Sq queries × Sk keys). Negative terms (noise) are clamped to 0; when
// the fit is unphysical (rate ≤ 0) only the largest sample's plain throughput is kept.
struct KernelSample {
  int64_t sq = 0, sk = 0;
  double seconds = 0;
};
struct KernelCostFit {
  double call_s = 0, tile_s = 0, flops = 0;
};
KernelCostFit fit_kernel_cost(const std::vector<KernelSample>& samples, int64_t heads, int64_t d,
                              double flops_per_pair);

// Times one ring_exchange of each size (send to next, receive from prev, wait), median of `reps`
// after a warm-up; every rank calls it, all get the same sizes. Returns seconds per exchange.
std::vector<double> measure_ring_steps(dist::ProcessGroup& pg, const std::vector<int64_t>& sizes,
                                       const at::Device& device, int reps);

// Times an exchange with `peer` (send and receive `bytes` at once) of each size, every rank at the
// same moment (a barrier before each repetition) until every pair is done (a barrier after it:
// pairs sharing a link finish unevenly), median of `reps` after a warm-up; a rank with no peer
// (-1) only joins the barriers. Collective. Returns seconds per exchange, the same on every rank.
std::vector<double> measure_pair_exchanges(dist::ProcessGroup& pg, int peer,
                                           const std::vector<int64_t>& sizes,
                                           const at::Device& device, int reps);

// Time of a small all_to_all entered right after `compute_s` of matmuls on every rank (all
// ranks start together after a barrier), median of `reps`: with more ranks than cores it
// includes waiting for peers that still hold a core (Link::sync_s is this minus the latency).
double measure_collective_after_compute(dist::ProcessGroup& pg, const at::Device& device,
                                        int reps, double compute_s);

// Latency and bandwidth of comm(B) = α + B/β from (bytes, seconds) samples: α is the least time
// among the smaller half of the sizes; β is the largest message's bytes over its time less α when
// that time exceeds 20 α (slow or shaped links), else the slope between the two largest.
Link fit_link(const std::vector<int64_t>& sizes, const std::vector<double>& seconds);

}  // namespace lvx::planner
