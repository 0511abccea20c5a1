// Multi-rank tests with real processes. A test calls run_ranks(n, "worker"), which starts n
// copies of the current test binary with torchrun-style variables (RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT on a free port) and LVX_TEST_WORKER=worker; in each copy, main()
// runs the registered worker instead of the tests and exits with its return value.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace lvx::testing {

struct RankResult {
  int exit_code = -1;   // process exit code, or 128+signal when killed
  std::string output;   // stdout and stderr together
  double seconds = 0;   // wall time until this rank ended
};

// Starts `world` ranks running `worker`; waits at most `timeout_s` (then kills them all and
// marks the stragglers with exit_code 124). `env` adds variables to every rank.
// Ranks run to their own end: a failing rank does not stop the others (fault tests need that).
std::vector<RankResult> run_ranks(int world, const std::string& worker, double timeout_s = 120,
                                  const std::map<std::string, std::string>& env = {},
                                  bool openmpi_style = false);

// Runs a shell command; returns its stdout and stderr, with "[exit status N]" appended when it
// did not exit 0.
std::string run_command(const std::string& cmd);

// Asserts every rank exited 0, printing each failing rank's output otherwise.
void expect_all_ok(const std::vector<RankResult>& results);

using WorkerFn = std::function<int()>;
std::map<std::string, WorkerFn>& worker_table();
struct WorkerRegistration {
  WorkerRegistration(const std::string& name, WorkerFn fn) { worker_table()[name] = fn; }
};

}  // namespace lvx::testing

// LVX_WORKER(name) { ...; return 0; }: body runs in each rank process started by run_ranks.
#define LVX_WORKER(name)                                                                 \
  static int lvx_worker_##name();                                                        \
  static ::lvx::testing::WorkerRegistration lvx_worker_reg_##name(#name, lvx_worker_##name); \
  static int lvx_worker_##name()
