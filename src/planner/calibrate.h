// Measurements behind `lvx calibrate`: this machine's attention and matmul throughput per dtype
// (through kernels/attention.h and ATen), and the latency and bandwidth of a ring step between
// local ranks (through dist::ProcessGroup), turned into the figures of a cluster config.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

#include "src/dist/process_group.h"
#include "src/planner/cluster_config.h"

namespace lvx::planner {

struct ThroughputSample {
  double forward_flops = 0;  // attention FLOP/s, FlashAttention convention (cost_model.h)
  double backward_flops = 0;
  double gemm_flops = 0;                 // dense matmul FLOP/s
  double forward_s = 0, backward_s = 0;  // median time of one call
  // A call on 16 tokens: the fixed cost per call (cost model: per round).
  double forward_call_s = 0, backward_call_s = 0;
  // Causal attention over a striped permutation of the tokens (every tile partly masked).
  double masked_forward_flops = 0, masked_backward_flops = 0;
};

// Times attention_forward / attention_backward on q [1, s, heads, d] against k, v of the same
// length (no mask, then causal over striped positions, then 16 tokens) and a square matmul of
// size `gemm_n`, median of `reps` after a warm-up, with `threads` intra-op threads (the share of
// the cores each of the ranks gets), throughputs scaled by `share` (< 1 when more ranks than
// cores compute at once).
ThroughputSample measure_throughput(at::ScalarType dtype, const at::Device& device, int64_t s,
                                    int64_t heads, int64_t d, int64_t gemm_n, int reps,
                                    int threads = 0, double share = 1.0);

// Times one ring_exchange of each size (send to next, receive from prev, wait), median of `reps`
// after a warm-up; every rank calls it, all get the same sizes. Returns seconds per exchange.
std::vector<double> measure_ring_steps(dist::ProcessGroup& pg, const std::vector<int64_t>& sizes,
                                       const at::Device& device, int reps);

// Latency and bandwidth of comm(B) = α + B/β from (bytes, seconds) samples: α is the least time
// among the smaller half of the sizes, β the slope between the two largest (where α no longer
// matters).
Link fit_link(const std::vector<int64_t>& sizes, const std::vector<double>& seconds);

}  // namespace lvx::planner
