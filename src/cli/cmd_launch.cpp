// `lvx launch --nproc N -- <command ...>`: N local ranks with torchrun's variables.
#include <iostream>

#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/planner/cluster_config.h"
#include "src/planner/emulation.h"

namespace {

// --inter-node / --intra-node, or --emulate's rates for `nproc` ranks of this machine.
lvx::dist::LinkRates link_rates(const lvx::cli::ArgParser& p, int nproc) {
  lvx::dist::LinkRates r;
  if (!p.get("emulate").empty()) {
    LVX_CHECK(p.get("inter-node").empty() && p.get("intra-node").empty(),
              "--emulate sets both rates: give it alone, or --inter-node/--intra-node");
    const auto target = lvx::planner::load_cluster_config(p.get("emulate"));
    const auto e = lvx::planner::emulate_cluster(target, lvx::planner::rank_attention_flops(nproc));
    std::cerr << "lvx launch: " << e.summary << "\n";
    return e.rates;
  }
  if (!p.get("inter-node").empty())
    r.inter_node_bytes_per_s = lvx::dist::parse_rate(p.get("inter-node"), "--inter-node");
  if (!p.get("intra-node").empty()) {
    LVX_CHECK(r.enabled(), "--intra-node needs --inter-node (the links between nodes)");
    r.intra_node_bytes_per_s = lvx::dist::parse_rate(p.get("intra-node"), "--intra-node");
  }
  return r;
}

int cmd_launch(int argc, char** argv) {
  lvx::cli::ArgParser p("lvx launch --nproc N [options] -- <command> [args...]",
                        "Start N local ranks of a command with RANK, WORLD_SIZE, LOCAL_RANK,\n"
                        "LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set (as torchrun does).\n"
                        "Each output line is prefixed with its rank and stays on its stream (a\n"
                        "rank's stdout on stdout, its stderr on stderr). If any rank fails, the\n"
                        "others are stopped and lvx launch exits with that rank's code.\n"
                        "No job hangs forever once a rank has exited: lvx ranks fail any\n"
                        "communication wait within LVX_DIST_TIMEOUT_S (default 60 s), so ranks\n"
                        "still running --exit-wait seconds (default 2 x LVX_DIST_TIMEOUT_S) after\n"
                        "another exited are stuck; they are stopped and lvx launch exits with\n"
                        "124. Like torchrun and mpirun, the total run time is not limited unless\n"
                        "--timeout is given.");
  lvx::cli::add_nproc_options(p, "2", "number of local ranks");
  p.add_option("nodes", 0, "1",
               "simulate this many nodes: LOCAL_WORLD_SIZE = nproc / nodes (the double ring "
               "and the inter-node byte counters follow it)");
  p.add_option("master-addr", 0, "127.0.0.1", "address of the rendezvous store (rank 0)");
  p.add_option("master-port", 0, "0", "port of the rendezvous store; 0 picks a free one");
  p.add_option("timeout", 't', "0",
               "stop every rank after this many seconds in total, exit 124 (0: no limit)");
  p.add_option("exit-wait", 0, "auto",
               "once a rank has exited, stop the ranks still running after this many seconds, "
               "exit 124 (auto: 2 x LVX_DIST_TIMEOUT_S, 120 s when unset; 0: wait forever)");
  p.add_option("grace", 0, "5", "seconds between SIGTERM and SIGKILL when stopping ranks");
  p.add_option("inter-node", 0, "",
               "emulate links between the --nodes: each node's link to the others at this rate,\n"
               "as tc writes it (200mbit, 10gbit). The ranks run in a private network namespace;\n"
               "needs CAP_NET_ADMIN (or user namespaces) and tc (docs/cluster.md)");
  p.add_option("intra-node", 0, "",
               "with --inter-node: each rank's link to the others of its node (default unshaped)");
  p.add_option("emulate", 0, "",
               "cluster config (configs/clusters/*.yaml): set both rates so that this machine's\n"
               "attention FLOP/s per link byte/s equals that cluster's (docs/cluster.md)");
  if (!p.parse(argc, argv)) return 0;
  LVX_CHECK(!p.rest().empty(), "no command given after -- (usage: lvx launch --nproc N -- cmd)");
  lvx::dist::LaunchOptions o;
  o.nproc = lvx::cli::checked_nproc(p);
  o.nodes = static_cast<int>(p.get_int("nodes", 1, o.nproc));
  LVX_CHECK(o.nodes >= 1 && o.nproc % o.nodes == 0, "--nodes ", o.nodes,
            " must be at least 1 and divide --nproc ", o.nproc);
  o.master_addr = p.get("master-addr");
  o.master_port = static_cast<int>(p.get_int("master-port", 0, 65535));
  o.timeout_s = p.get_double("timeout");
  LVX_CHECK(o.timeout_s >= 0, "--timeout must be seconds >= 0 (0: no limit), got ", o.timeout_s);
  o.exit_wait_s =
      p.get("exit-wait") == "auto" ? lvx::dist::default_exit_wait_s() : p.get_double("exit-wait");
  LVX_CHECK(o.exit_wait_s >= 0, "--exit-wait must be 'auto' or seconds >= 0, got ",
            p.get("exit-wait"));
  o.grace_s = p.get_double("grace");
  LVX_CHECK(o.grace_s >= 0, "--grace must be seconds >= 0, got ", o.grace_s);
  o.links = link_rates(p, o.nproc);
  auto r = lvx::dist::launch_local(p.rest(), o);
  return r.exit_code;
}

}  // namespace

LVX_COMMAND("launch", "start N local ranks of a command (torchrun-style variables)", cmd_launch);
