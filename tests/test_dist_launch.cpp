// lvx launch (src/dist/launcher.h): local ranks with their variables, prefixed output and
// separate streams, core sharing, simulated nodes, exit codes, and stopping stuck ranks.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "tests/build_paths.h"
#include "tests/multirank.h"

TEST(Launch, PrefixesOutputAndSetsVariables) {
  lvx::dist::LaunchOptions o;
  o.nproc = 3;
  o.capture = true;
  auto r = lvx::dist::launch_local(
      {"sh", "-c", "echo rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK addr=$MASTER_ADDR"}, o);
  EXPECT_EQ(r.exit_code, 0);
  for (int i = 0; i < 3; ++i)
    EXPECT_EQ(r.ranks[i].output, "rank=" + std::to_string(i) +
                                     " world=3 local=" + std::to_string(i) + " addr=127.0.0.1\n");
}

// Unless OMP_NUM_THREADS is set, each of N ranks gets the cores this process may use divided by N
// threads, a single rank too (libtorch's own default counts the host's cores).
TEST(Launch, RanksShareTheCoresBetweenThem) {
  const char* saved = std::getenv("OMP_NUM_THREADS");
  const std::string keep = saved ? saved : "";
  ::unsetenv("OMP_NUM_THREADS");
  const int cores = lvx::dist::available_cores();
  EXPECT_GE(cores, 1);
  for (int n : {1, 2}) {
    lvx::dist::LaunchOptions o;
    o.nproc = n;
    o.capture = true;
    auto r = lvx::dist::launch_local({"sh", "-c", "echo threads=$OMP_NUM_THREADS"}, o);
    EXPECT_EQ(r.exit_code, 0);
    for (int i = 0; i < n; ++i)
      EXPECT_EQ(r.ranks[i].output, lvx::str("threads=", std::max(1, cores / n), "\n")) << n;
  }
  if (saved) ::setenv("OMP_NUM_THREADS", keep.c_str(), 1);
}

TEST(Launch, SimulatedNodesSetTheLocalVariables) {
  lvx::dist::LaunchOptions o;
  o.nproc = 4;
  o.nodes = 2;
  o.capture = true;
  auto r = lvx::dist::launch_local(
      {"sh", "-c", "echo rank=$RANK local=$LOCAL_RANK of $LOCAL_WORLD_SIZE node=$GROUP_RANK"}, o);
  EXPECT_EQ(r.exit_code, 0);
  for (int i = 0; i < 4; ++i)
    EXPECT_EQ(r.ranks[i].output, "rank=" + std::to_string(i) + " local=" + std::to_string(i % 2) +
                                     " of 2 node=" + std::to_string(i / 2) + "\n");
  o.nodes = 3;
  try {
    lvx::dist::launch_local({"true"}, o);
    FAIL() << "3 nodes of 4 ranks were accepted";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--nodes 3 must be at least 1 and divide --nproc 4"),
              std::string::npos)
        << e.what();
  }
}

TEST(Launch, CliExitCodeAndStopsOthers) {
  const std::string lvx = lvx::testing::binary_dir() + "/lvx";
  if (::access(lvx.c_str(), X_OK) != 0) GTEST_SKIP() << "lvx executable not built";
  auto t0 = std::chrono::steady_clock::now();
  int rc = std::system((lvx + " launch --nproc 3 -- sh -c 'if [ $RANK = 1 ]; then exit 3; fi; "
                              "sleep 60' > /tmp/lvx_launch_test.txt 2>&1")
                           .c_str());
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(WEXITSTATUS(rc), 3);
  EXPECT_LT(s, 30) << "the sleeping ranks were not stopped";
  rc = std::system(
      (lvx + " launch --nproc 2 -- sh -c 'echo hello' > /tmp/lvx_launch_ok.txt").c_str());
  EXPECT_EQ(WEXITSTATUS(rc), 0);
  std::FILE* f = std::fopen("/tmp/lvx_launch_ok.txt", "r");
  ASSERT_NE(f, nullptr);
  char buf[256] = {0};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::string out(buf, n);
  EXPECT_NE(out.find("[rank 0] hello"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 1] hello"), std::string::npos) << out;
}

// Each rank's stderr reaches the launcher's stderr and its stdout the launcher's stdout (both
// prefixed), so that `lvx qa ... > answer.txt` never hides a rank's error in the answer file.
TEST(Launch, CliKeepsEachRanksStreamsApart) {
  const std::string lvx = lvx::testing::binary_dir() + "/lvx";
  if (::access(lvx.c_str(), X_OK) != 0) GTEST_SKIP() << "lvx executable not built";
  const std::string out_path = "/tmp/lvx_launch_streams_out.txt";
  const std::string err_path = "/tmp/lvx_launch_streams_err.txt";
  const int rc = std::system((lvx + " launch --nproc 2 -- sh -c 'echo result$RANK; echo " +
                              "problem$RANK >&2' > " + out_path + " 2> " + err_path)
                                 .c_str());
  EXPECT_EQ(WEXITSTATUS(rc), 0);
  auto slurp = [](const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "r");
    if (!f) return std::string();
    char buf[4096] = {0};
    const size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
    std::fclose(f);
    return std::string(buf, n);
  };
  const std::string out = slurp(out_path), err = slurp(err_path);
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(out.find(lvx::str("[rank ", r, "] result", r)), std::string::npos) << out;
    EXPECT_NE(err.find(lvx::str("[rank ", r, "] problem", r)), std::string::npos) << err;
  }
  EXPECT_EQ(out.find("problem"), std::string::npos) << out;
  EXPECT_EQ(err.find("result"), std::string::npos) << err;
}

// Rank 0 ends; the others never do (stuck outside any communication). The launch stops them
// 2 × LVX_DIST_TIMEOUT_S later by default, names them and fails with 124.
TEST(Launch, StuckRanksAreStoppedAfterAnotherExits) {
  lvx::dist::LaunchOptions o;
  o.nproc = 3;
  o.capture = true;
  o.grace_s = 1;
  o.env["LVX_DIST_TIMEOUT_S"] = "0.5";
  EXPECT_EQ(lvx::dist::default_exit_wait_s(o.env), 1.0);
  auto t0 = std::chrono::steady_clock::now();
  auto r = lvx::dist::launch_local({"sh", "-c", "[ $RANK = 0 ] && exit 0; exec sleep 60"}, o);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(s, 10) << "the stuck ranks were not stopped";
  EXPECT_EQ(r.exit_code, 124);
  EXPECT_EQ(r.first_failed, 1);
  EXPECT_EQ(r.ranks[0].exit_code, 0);
  for (int i = 1; i < 3; ++i) {
    EXPECT_EQ(r.ranks[i].exit_code, 124);
    EXPECT_NE(r.ranks[i].output.find("after rank 0 exited with code 0"), std::string::npos)
        << r.ranks[i].output;
    EXPECT_NE(r.ranks[i].output.find("stopping ranks 1,2"), std::string::npos) << r.ranks[i].output;
  }
}

// A rank that ends within the wait is not stopped; exit_wait_s = 0 waits forever.
TEST(Launch, ExitWaitSparesRanksThatEndInTime) {
  lvx::dist::LaunchOptions o;
  o.nproc = 2;
  o.capture = true;
  o.env["LVX_DIST_TIMEOUT_S"] = "2";  // 4 s
  auto r = lvx::dist::launch_local({"sh", "-c", "[ $RANK = 0 ] && exit 0; sleep 1"}, o);
  EXPECT_EQ(r.exit_code, 0) << r.ranks[1].output;
  o.env["LVX_DIST_TIMEOUT_S"] = "0.2";  // 0.4 s by default, but disabled:
  o.exit_wait_s = 0;
  r = lvx::dist::launch_local({"sh", "-c", "[ $RANK = 0 ] && exit 0; sleep 1"}, o);
  EXPECT_EQ(r.exit_code, 0) << r.ranks[1].output;
}

// The same through the CLI, with the default taken from the launcher's own environment.
TEST(Launch, CliStopsStuckRanksWithExitCode124) {
  const std::string lvx = lvx::testing::binary_dir() + "/lvx";
  if (::access(lvx.c_str(), X_OK) != 0) GTEST_SKIP() << "lvx executable not built";
  const std::string log = "/tmp/lvx_launch_stuck_" + std::to_string(::getpid()) + ".txt";
  auto t0 = std::chrono::steady_clock::now();
  const std::string cmd = "LVX_DIST_TIMEOUT_S=0.5 " + lvx +
                          " launch --nproc 2 --grace 1 -- sh -c "
                          "'[ $RANK = 0 ] && exit 0; exec sleep 60' > " +
                          log + " 2>&1";
  int rc = std::system(cmd.c_str());
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(WEXITSTATUS(rc), 124);
  EXPECT_LT(s, 10) << "the stuck rank was not stopped";
  std::FILE* f = std::fopen(log.c_str(), "r");
  ASSERT_NE(f, nullptr);
  char buf[4096] = {0};
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  std::remove(log.c_str());
  std::string out(buf, n);
  EXPECT_NE(out.find("so these are stuck; stopping rank 1 (exit 124)"), std::string::npos) << out;
}

// A torch.distributed program under lvx launch: init_process_group("gloo") from the variables the
// launch sets (env://) joins the launcher's store, as under torchrun (a launcher that handed rank 0
// a socket to serve on instead would leave Python's rank 0 unable to bind MASTER_PORT). The program
// ends with destroy_process_group(), as PyTorch asks: a gloo group left to the interpreter's exit
// can abort one rank ("terminate called without an active exception") once its peer has gone, which
// CI saw once.
TEST(Launch, TorchDistributedProgramsJoinTheLaunchersStore) {
  const std::string lvx = lvx::testing::binary_dir() + "/lvx";
  if (::access(lvx.c_str(), X_OK) != 0) GTEST_SKIP() << "lvx executable not built";
  const std::string program =
      "import torch, torch.distributed as d; d.init_process_group('gloo'); "
      "t = torch.tensor([1.0 + d.get_rank()]); d.all_reduce(t); print('sum', int(t.item())); "
      "d.destroy_process_group()";
  const std::string out =
      lvx::testing::run_command(lvx + " launch --nproc 2 -- " + lvx::testing::configured_python() +
                                " -c \"" + program + "\"");
  EXPECT_EQ(out.find("exit status"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 0] sum 3"), std::string::npos) << out;
  EXPECT_NE(out.find("[rank 1] sum 3"), std::string::npos) << out;
  EXPECT_EQ(out.find("failed to bind"), std::string::npos) << out;
}
