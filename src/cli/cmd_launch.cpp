// `lvx launch --nproc N -- <command ...>`: N local ranks with torchrun's variables.
#include "src/cli/args.h"
#include "src/cli/cluster_options.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/dist/launcher.h"

namespace {

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
  p.add_option(
      "master-port", 0, "0",
      "port of the rendezvous store (rank 0 hosts it); 0: lvx launch hosts it on a free one");
  p.add_option("timeout", 't', "0",
               "stop every rank after this many seconds in total, exit 124 (0: no limit)");
  p.add_option("exit-wait", 0, "auto",
               "once a rank has exited, stop the ranks still running after this many seconds, "
               "exit 124 (auto: 2 x LVX_DIST_TIMEOUT_S, 120 s when unset; 0: wait forever)");
  p.add_option("grace", 0, "5", "seconds between SIGTERM and SIGKILL when stopping ranks");
  lvx::cli::add_link_options(p);
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
  o.links = lvx::cli::link_rates(p, o.nproc);
  auto r = lvx::dist::launch_local(p.rest(), o);
  return r.exit_code;
}

}  // namespace

LVX_COMMAND("launch", "start N local ranks of a command (torchrun-style variables)", cmd_launch);
