// The emulated-cluster options; see cluster_options.h.
#include "src/cli/cluster_options.h"

#include <iostream>

#include "src/common/error.h"
#include "src/planner/cluster_config.h"
#include "src/planner/emulation.h"

namespace lvx::cli {

void add_link_options(ArgParser& p) {
  p.add_option("inter-node", 0, "",
               "emulate links between the --nodes: each node's link to the others at this rate,\n"
               "as tc writes it (200mbit, 10gbit). The ranks run in a private network namespace;\n"
               "needs CAP_NET_ADMIN (or user namespaces) and tc (docs/cluster.md)");
  p.add_option("intra-node", 0, "",
               "with --inter-node: each rank's link to the others of its node (default unshaped)");
  p.add_option("emulate", 0, "",
               "cluster config (configs/clusters/*.yaml): set both rates so that this machine's\n"
               "attention FLOP/s per link byte/s equals that cluster's (docs/cluster.md)");
}

dist::LinkRates link_rates(const ArgParser& p, int nproc) {
  dist::LinkRates r;
  if (!p.get("emulate").empty()) {
    LVX_CHECK(p.get("inter-node").empty() && p.get("intra-node").empty(),
              "--emulate sets both rates: give it alone, or --inter-node/--intra-node");
    const auto target = planner::load_cluster_config(p.get("emulate"));
    const auto e = planner::emulate_cluster(target, planner::rank_attention_flops(nproc));
    std::cerr << "lvx: " << e.summary << "\n";
    return e.rates;
  }
  if (!p.get("inter-node").empty())
    r.inter_node_bytes_per_s = dist::parse_rate(p.get("inter-node"), "--inter-node");
  if (!p.get("intra-node").empty()) {
    LVX_CHECK(r.enabled(), "--intra-node needs --inter-node (the links between nodes)");
    r.intra_node_bytes_per_s = dist::parse_rate(p.get("intra-node"), "--intra-node");
  }
  return r;
}

}  // namespace lvx::cli
