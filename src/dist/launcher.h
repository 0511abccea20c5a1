// Starts N local ranks of a command the way torchrun does: each gets RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. Their output is prefixed with the
// rank ("[rank 2] ..."), and if any rank fails the others are stopped (SIGTERM, then SIGKILL
// after a grace period) and the launch fails with that rank's exit code. Unless OMP_NUM_THREADS
// is set, each of N ranks gets cores / N OpenMP threads (torchrun sets it too). Used by `lvx launch`,
// by commands that run themselves on N ranks (`lvx attention --nproc N`), and by the tests.
#pragma once

#include <map>
#include <string>
#include <vector>

namespace lvx::dist {

struct LaunchOptions {
  int nproc = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                       // 0: pick a free port
  std::map<std::string, std::string> env;    // extra variables for every rank
  bool capture = false;                      // keep each rank's output instead of printing it
  double timeout_s = 0;                      // > 0: stop every rank after this long (exit 124)
  double grace_s = 5;                        // SIGTERM → SIGKILL delay when stopping ranks
  bool stop_on_failure = true;               // stop the others when one rank fails
  bool openmpi_style = false;                // set OMPI_COMM_WORLD_* instead of RANK/WORLD_SIZE
};

struct RankExit {
  int rank = 0;
  int exit_code = -1;  // exit status, or 128 + signal number; 124 when stopped by timeout
  std::string output;  // with capture: stdout and stderr interleaved
  double seconds = 0;
};

struct LaunchResult {
  std::vector<RankExit> ranks;
  int exit_code = 0;       // 0 when every rank exited 0, else the first failing rank's code
  int first_failed = -1;   // rank that failed first, or -1
};

// Runs argv (argv[0] found on PATH or given as a path) on opts.nproc local ranks.
LaunchResult launch_local(const std::vector<std::string>& argv, const LaunchOptions& opts);

// Path of the running executable (/proc/self/exe), so a program can start itself as ranks.
std::string self_executable();

// For programs that run themselves on N ranks (benchmarks): when RANK/WORLD_SIZE are not set,
// starts `nproc` ranks of this executable with argv[1..], prints rank 0's output (and that of
// any failing rank) and returns the launch's exit code; returns -1 when already a rank.
int relaunch_self_as_ranks(int nproc, int argc, char** argv);

// A TCP port on 127.0.0.1 that is free right now.
int free_port();

// Human-readable description of a rank's exit ("exited with code 3", "was killed by SIGKILL").
std::string describe_exit(int exit_code);

}  // namespace lvx::dist
