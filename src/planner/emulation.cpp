// The emulated cluster's rates; see emulation.h.
#include "src/planner/emulation.h"

#include <algorithm>
#include <sstream>

#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/planner/calibrate.h"

namespace lvx::planner {

double rank_attention_flops(int nproc, int reps) {
  const int cores = dist::available_cores();
  const int threads = std::max(1, cores / std::max(1, nproc));
  const double share = std::min(1.0, double(cores) / std::max(1, nproc));
  // The problem lvx calibrate times by default: 512 tokens, 8 heads of 64.
  return measure_throughput(at::kFloat, at::Device(at::kCPU), 512, 8, 64, 256, reps, threads,
                            share)
      .attention.forward_flops;
}

Emulation emulate_cluster(const ClusterConfig& target, double here_flops,
                          const std::string& target_dtype) {
  LVX_CHECK(here_flops > 0, "emulated cluster: this machine's attention throughput is ",
            here_flops);
  Emulation e;
  e.here_flops = here_flops;
  e.target_flops = target.attention_for(target_dtype).forward_flops;
  LVX_CHECK(e.target_flops > 0 && target.inter_node.bandwidth_bytes_per_s > 0 &&
                target.intra_node.bandwidth_bytes_per_s > 0,
            target.name, ": --emulate needs attention_tflops.", target_dtype,
            ".forward and both links' bandwidth");
  const double ratio = here_flops / e.target_flops;
  e.rates.inter_node_bytes_per_s = target.inter_node.bandwidth_bytes_per_s * ratio;
  e.rates.intra_node_bytes_per_s = target.intra_node.bandwidth_bytes_per_s * ratio;
  std::ostringstream o;
  o << "emulating " << target.name << ": attention " << here_flops / 1e9 << " GFLOP/s per rank here"
    << " against " << e.target_flops / 1e12 << " TFLOP/s there (" << target_dtype
    << "), so links run " << ratio << " times theirs: inter-node "
    << dist::format_rate(e.rates.inter_node_bytes_per_s) << " per node (there "
    << target.inter_node.bandwidth_bytes_per_s / 1e9 << " GB/s), intra-node "
    << dist::format_rate(e.rates.intra_node_bytes_per_s) << " per rank (there "
    << target.intra_node.bandwidth_bytes_per_s / 1e9 << " GB/s)";
  e.summary = o.str();
  return e;
}

}  // namespace lvx::planner
