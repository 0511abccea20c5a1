// An emulated cluster in a target cluster's proportions (`lvx launch --emulate C.yaml`). These
// cores compute 10^3-10^4 times slower than a datacenter GPU, so a link must be that much slower to
// be the same cluster: what matters to every strategy choice is FLOP per byte. For each link kind
//     rate = B(target) × F(here) / F(target)
// with B the target's bandwidth (inter_node per node, intra_node per GPU, as cluster configs hold
// them) and F the attention forward throughput of one rank, FlashAttention's FLOP convention: the
// target's (its `attention_tflops` in bf16, what its GPUs run) and this machine's for one of
// `nproc` local ranks in fp32 (measured as `lvx calibrate` does: each rank's share of the cores).
// `lvx calibrate` on the emulated cluster then reports F/B within a few percent of the target's
// (docs/cluster.md); the links add no latency (emulated_cluster.h).
#pragma once

#include <string>

#include "src/dist/emulated_cluster.h"
#include "src/planner/cluster_config.h"

namespace lvx::planner {

struct Emulation {
  dist::LinkRates rates;
  double here_flops = 0, target_flops = 0;  // attention forward FLOP/s per rank
  std::string summary;                      // one line for people: the figures and the rates
};

// This machine's attention forward FLOP/s for one of `nproc` local ranks (fp32, CPU), as lvx
// calibrate measures it.
double rank_attention_flops(int nproc, int reps = 5);

// The rates that put this machine's ranks in `target`'s ratio, from F(here) = here_flops.
Emulation emulate_cluster(const ClusterConfig& target, double here_flops,
                          const std::string& target_dtype = "bf16");

}  // namespace lvx::planner
