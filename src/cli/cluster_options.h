// The emulated-cluster options shared by `lvx launch`, `lvx calibrate` and benchmarks/bench_cluster:
// --nodes, --inter-node, --intra-node and --emulate (src/dist/emulated_cluster.h,
// src/planner/emulation.h).
#pragma once

#include "src/cli/args.h"
#include "src/dist/emulated_cluster.h"

namespace lvx::cli {

// Declares --inter-node, --intra-node and --emulate (--nodes is the command's own).
void add_link_options(ArgParser& p);

// The rates those options give for `nproc` local ranks: --inter-node/--intra-node as written, or
// --emulate's, which times this machine's attention first and prints how it scaled the cluster's
// links; disabled (no emulation) when none is given.
dist::LinkRates link_rates(const ArgParser& p, int nproc);

}  // namespace lvx::cli
