// Starts N local ranks of a command the way torchrun does: each gets RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Their output is prefixed with the
// rank ("[rank 2] ...") and stays on its stream (a rank's stdout on the launcher's stdout, its
// stderr on the launcher's stderr: errors never hide in a redirected result), and if any rank fails
// the others are stopped (SIGTERM, then SIGKILL after a grace period) and the launch fails with
// that rank's exit code. Unless OMP_NUM_THREADS is set, each of N ranks gets cores / N OpenMP
// threads (torchrun sets it too). Used by `lvx launch`, by commands that run themselves on N ranks
// (`lvx attention --nproc N`), and by tests.
//
// Time limits. No job hangs forever once one of its ranks has ended: every lvx collective involves
// every rank, and a rank fails any communication wait within LVX_DIST_TIMEOUT_S (default 60 s),
// then exits. A rank still running 2 × LVX_DIST_TIMEOUT_S after another rank exited (successfully:
// a failure stops the others at once) is therefore no longer communicating: it is stuck. The
// launch then stops the remaining ranks and fails with exit code 124, naming them
// (LaunchOptions::exit_wait_s, `lvx launch --exit-wait`). A job whose ranks legitimately work
// alone for longer after a peer ended raises it, or sets 0. As with torchrun and mpirun, the total
// run time is not limited unless asked for (timeout_s, `lvx launch --timeout`).
#pragma once

#include <map>
#include <string>
#include <vector>

#include "src/dist/emulated_cluster.h"

namespace lvx::dist {

struct LaunchOptions {
  int nproc = 1;
  // Simulated nodes (nproc must divide by it): LOCAL_WORLD_SIZE = nproc / nodes and LOCAL_RANK =
  // rank mod that, as torchrun sets them on each of `nodes` machines, so that topology-aware
  // code (the double ring, the inter-node byte counters) runs on one machine.
  int nodes = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                     // 0: pick a free port
  std::map<std::string, std::string> env;  // extra variables for every rank
  bool capture = false;                    // keep each rank's output instead of printing it
  double timeout_s = 0;                    // > 0: stop every rank after this long (exit 124)
  // > 0: once a rank has exited, stop the ranks still running after this long (exit 124);
  // 0: wait for them forever; < 0 (default): default_exit_wait_s(env), or 0 when
  // stop_on_failure is false.
  double exit_wait_s = -1;
  double grace_s = 5;  // SIGTERM → SIGKILL delay when stopping ranks
  // Stop the others when one rank fails. false: every rank runs to its own end (fault tests),
  // stopped only by timeout_s or an explicit exit_wait_s.
  bool stop_on_failure = true;
  bool openmpi_style = false;  // set OMPI_COMM_WORLD_* instead of RANK/WORLD_SIZE
  // Rank 0 writes to the launcher's own stdout and stderr, unprefixed (its stdout is the
  // command's result: lvx qa's streamed answer or JSON); the other ranks stay prefixed.
  // Ignored with capture.
  bool rank0_direct = false;
  // SIGTERM or SIGINT sent to the launcher goes on to every rank (once), and the launch waits for
  // them to end as they choose (a server finishing its requests); without it the launcher dies
  // of the signal and its ranks with it.
  bool forward_signals = false;
  // Emulated links between the `nodes` (src/dist/emulated_cluster.h): with an inter-node rate the
  // ranks run in a private network namespace whose links are shaped to these rates, each rank on
  // its node's addresses; the launching process moves into that namespace for good.
  LinkRates links;
};

// 2 × LVX_DIST_TIMEOUT_S, read from `env` (the ranks' extra variables) or else this process's
// environment; 120 s when unset.
double default_exit_wait_s(const std::map<std::string, std::string>& env = {});

struct RankExit {
  int rank = 0;
  int exit_code = -1;  // exit status, or 128 + signal number; 124 when stopped by a time limit
  std::string output;  // with capture: stdout and stderr interleaved
  double seconds = 0;
};

struct LaunchResult {
  std::vector<RankExit> ranks;
  int exit_code = 0;      // 0 when every rank exited 0, else the first failing rank's code
  int first_failed = -1;  // rank that failed first (or the first one stopped), or -1
};

// Runs argv (argv[0] found on PATH or given as a path) on opts.nproc local ranks.
LaunchResult launch_local(const std::vector<std::string>& argv, const LaunchOptions& opts);

// Path of the running executable (/proc/self/exe), so a program can start itself as ranks.
std::string self_executable();

// For programs that run themselves on N ranks (benchmarks): when RANK/WORLD_SIZE are not set,
// starts `nproc` ranks of this executable with argv[1..], prints rank 0's output (and that of
// any failing rank) and returns the launch's exit code; returns -1 when already a rank.
int relaunch_self_as_ranks(int nproc, int argc, char** argv);

// The cores this process may run on: its CPU affinity, bounded by a cgroup v2 CPU quota
// (/sys/fs/cgroup/cpu.max). Ranks on one machine share them: each of N local ranks gets
// available_cores() / N intra-op threads unless told otherwise (OMP_NUM_THREADS, --threads).
int available_cores();

// Human-readable description of a rank's exit ("exited with code 3", "was killed by SIGKILL").
std::string describe_exit(int exit_code);

}  // namespace lvx::dist
