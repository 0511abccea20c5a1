// Rendezvous: torchrun and Open MPI variables parsed into a rank's place in the world, bad
// values named, real rank processes joining from Open MPI's variables, the store's port held from
// the launcher's store, and a store hosted outside the launch as torchrun's agent hosts it.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <map>
#include <string>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "src/common/error.h"
#include "src/dist/process_group.h"
#include "src/dist/rendezvous.h"
#include "tests/multirank.h"

using lvx::dist::ProcessGroup;

TEST(Rendezvous, TorchrunVariablesFirst) {
  auto i = lvx::dist::rendezvous_from_env({{"RANK", "2"},
                                           {"WORLD_SIZE", "4"},
                                           {"LOCAL_RANK", "0"},
                                           {"MASTER_ADDR", "10.0.0.1"},
                                           {"MASTER_PORT", "1234"},
                                           {"OMPI_COMM_WORLD_RANK", "3"},
                                           {"OMPI_COMM_WORLD_SIZE", "8"}});
  EXPECT_EQ(i.source, "torchrun");
  EXPECT_EQ(i.rank, 2);
  EXPECT_EQ(i.world_size, 4);
  EXPECT_EQ(i.local_rank, 0);
  EXPECT_EQ(i.master_addr, "10.0.0.1");
  EXPECT_EQ(i.master_port, 1234);
}

TEST(Rendezvous, OpenMpiVariables) {
  auto i = lvx::dist::rendezvous_from_env({{"OMPI_COMM_WORLD_RANK", "3"},
                                           {"OMPI_COMM_WORLD_SIZE", "8"},
                                           {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  EXPECT_EQ(i.source, "openmpi");
  EXPECT_EQ(i.rank, 3);
  EXPECT_EQ(i.world_size, 8);
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.master_port, 29500);
}

// A task of an srun step: its place from SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID, its
// node's task count from the compressed SLURM_STEP_TASKS_PER_NODE, the master the node list's
// first host (MASTER_ADDR wins). A batch script's own variables (no step) are no rank.
TEST(Rendezvous, SlurmStepVariables) {
  const std::map<std::string, std::string> task{{"SLURM_PROCID", "9"},
                                                {"SLURM_STEP_ID", "0"},
                                                {"SLURM_STEP_NUM_TASKS", "12"},
                                                {"SLURM_NTASKS", "16"},
                                                {"SLURM_LOCALID", "1"},
                                                {"SLURM_NODEID", "2"},
                                                {"SLURM_STEP_TASKS_PER_NODE", "4(x2),4"},
                                                {"SLURM_STEP_NODELIST", "gpu[07-08,12]"},
                                                {"SLURM_JOB_NODELIST", "other1"}};
  auto i = lvx::dist::rendezvous_from_env(task);
  EXPECT_EQ(i.source, "slurm");
  EXPECT_EQ(i.rank, 9);
  EXPECT_EQ(i.world_size, 12);  // the step's tasks, not the job's
  EXPECT_EQ(i.local_rank, 1);
  EXPECT_EQ(i.local_world_size, 4);
  EXPECT_EQ(i.master_addr, "gpu07");
  auto with_master = task;
  with_master["MASTER_ADDR"] = "10.1.2.3";
  EXPECT_EQ(lvx::dist::rendezvous_from_env(with_master).master_addr, "10.1.2.3");
  auto batch_script = task;
  batch_script.erase("SLURM_STEP_ID");
  EXPECT_EQ(lvx::dist::rendezvous_from_env(batch_script).world_size, 1);
  EXPECT_EQ(lvx::dist::first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(lvx::dist::first_slurm_host("a3,b[1-2]"), "a3");
  EXPECT_EQ(lvx::dist::first_slurm_host("n[001-004]"), "n001");
  EXPECT_EQ(lvx::dist::slurm_tasks_on_node("8(x2),2", 1), 8);
  EXPECT_EQ(lvx::dist::slurm_tasks_on_node("8(x2),2", 2), 2);
  EXPECT_THROW(lvx::dist::slurm_tasks_on_node("8(x2)", 5), lvx::Error);
}

TEST(Rendezvous, NoVariablesIsOneRank) {
  auto i = lvx::dist::rendezvous_from_env(std::map<std::string, std::string>{});
  EXPECT_EQ(i.world_size, 1);
  EXPECT_EQ(i.rank, 0);
}

TEST(Rendezvous, BadValuesNameTheVariable) {
  auto msg = [](std::map<std::string, std::string> env) {
    try {
      lvx::dist::rendezvous_from_env(env);
    } catch (const lvx::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(msg({{"RANK", "4"}, {"WORLD_SIZE", "4"}}).find("RANK=4"), std::string::npos);
  EXPECT_NE(msg({{"RANK", "x"}, {"WORLD_SIZE", "4"}}).find("RANK='x'"), std::string::npos);
  EXPECT_NE(msg({{"RANK", "0"}}).find("WORLD_SIZE"), std::string::npos);
  EXPECT_NE(msg({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}).find("MASTER_PORT"),
            std::string::npos);
}

namespace {

// errno of binding an IPv4 socket to `port` on every address (0: the bind succeeded).
int bind_errno(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  const int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 ? 0 : errno;
  ::close(fd);
  return rc;
}

int sum_of_ranks(ProcessGroup& pg) {
  at::Tensor t = at::full({1}, static_cast<float>(pg.rank()));
  pg.all_reduce(t);
  return static_cast<int>(t.item<float>());
}

}  // namespace

LVX_WORKER(openmpi_join) {
  auto info = lvx::dist::rendezvous_from_env();
  if (info.source != "openmpi") return 3;
  ProcessGroup pg(info);
  return sum_of_ranks(pg) == pg.world_size() * (pg.world_size() - 1) / 2 ? 0 : 1;
}

TEST(Rendezvous, RanksJoinFromOpenMpiVariables) {
  lvx::testing::expect_all_ok(lvx::testing::run_ranks(3, "openmpi_join", 60, {}, true));
}

// lvx launch without --master-port hosts the store before any rank starts, as torchrun's agent
// does: MASTER_PORT is taken (no other process can bind it, the EADDRINUSE rank 0 once hit in CI
// when another job's connection drew the port a launcher had chosen and released), and the ranks
// are told to join it (TORCHELASTIC_USE_AGENT_STORE=True).
LVX_WORKER(launcher_hosts_store) {
  const auto info = lvx::dist::rendezvous_from_env();
  if (!info.agent_store) return 3;
  if (bind_errno(info.master_port) != EADDRINUSE) return 4;
  ProcessGroup pg(info);
  return sum_of_ranks(pg) == info.world_size * (info.world_size - 1) / 2 ? 0 : 1;
}

TEST(Rendezvous, LaunchHostsTheStoreBeforeAnyRankStarts) {
  lvx::testing::expect_all_ok(lvx::testing::run_ranks(3, "launcher_hosts_store", 60));
}

// torchrun's agent hosts the store at MASTER_PORT (TORCHELASTIC_USE_AGENT_STORE=True): every rank
// joins it as a client, as torch.distributed does, instead of rank 0 failing to bind the port
// (c10d then prints an error it ignores).
LVX_WORKER(agent_store_join) {
  const auto info = lvx::dist::rendezvous_from_env();
  if (!info.agent_store) return 3;
  ProcessGroup pg(info);
  return sum_of_ranks(pg) == info.world_size * (info.world_size - 1) / 2 ? 0 : 1;
}

TEST(Rendezvous, TorchrunsAgentStoreIsJoinedNotHosted) {
  EXPECT_TRUE(
      lvx::dist::rendezvous_from_env({{"TORCHELASTIC_USE_AGENT_STORE", "True"}}).agent_store);
  EXPECT_FALSE(
      lvx::dist::rendezvous_from_env({{"TORCHELASTIC_USE_AGENT_STORE", "False"}}).agent_store);
  c10d::TCPStoreOptions o;
  o.port = 0;
  o.isServer = true;
  o.waitWorkers = false;
  c10d::TCPStore agent("127.0.0.1", o);  // the agent's store, in this process
  auto r = lvx::testing::run_ranks(
      2, "agent_store_join", 60,
      {{"TORCHELASTIC_USE_AGENT_STORE", "True"}, {"MASTER_PORT", std::to_string(agent.getPort())}});
  lvx::testing::expect_all_ok(r);
  for (const auto& rank : r)
    EXPECT_EQ(rank.output.find("failed to bind"), std::string::npos) << rank.output;
}
