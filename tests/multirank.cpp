#include "tests/multirank.h"

#include <gtest/gtest.h>

#include <cstdio>

#include "src/dist/launcher.h"

namespace lvx::testing {

std::map<std::string, WorkerFn>& worker_table() {
  static std::map<std::string, WorkerFn> table;
  return table;
}

std::vector<RankResult> run_ranks(int world, const std::string& worker, double timeout_s,
                                  const std::map<std::string, std::string>& env,
                                  bool openmpi_style) {
  dist::LaunchOptions o;
  o.nproc = world;
  o.capture = true;
  o.timeout_s = timeout_s;
  o.grace_s = 2;
  o.stop_on_failure = false;
  o.openmpi_style = openmpi_style;
  o.env = env;
  o.env["LVX_TEST_WORKER"] = worker;
  if (!o.env.count("LVX_DIST_TIMEOUT_S")) o.env["LVX_DIST_TIMEOUT_S"] = "20";
  // Ranks of a test share 2 cores with the other tests ctest runs in parallel.
  if (!o.env.count("OMP_NUM_THREADS")) o.env["OMP_NUM_THREADS"] = "1";
  auto r = dist::launch_local({dist::self_executable()}, o);
  std::vector<RankResult> out;
  for (const auto& e : r.ranks) out.push_back({e.exit_code, e.output, e.seconds});
  return out;
}

void expect_all_ok(const std::vector<RankResult>& results) {
  for (size_t r = 0; r < results.size(); ++r)
    EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << " output:\n" << results[r].output;
}

std::string run_command(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  char buf[4096];
  while (p && std::fgets(buf, sizeof(buf), p)) out += buf;
  int rc = p ? ::pclose(p) : -1;
  if (rc != 0) out += "\n[exit status " + std::to_string(rc) + "]";
  return out;
}

}  // namespace lvx::testing
