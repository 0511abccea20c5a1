// Rendezvous: torchrun and Open MPI variables parsed into a rank's place in the world, bad
// values named, and real rank processes joining from Open MPI's variables.
#include <gtest/gtest.h>

#include <map>
#include <string>

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

LVX_WORKER(openmpi_join) {
  auto info = lvx::dist::rendezvous_from_env();
  if (info.source != "openmpi") return 3;
  ProcessGroup pg(info);
  at::Tensor t = at::full({1}, static_cast<float>(pg.rank()));
  pg.all_reduce(t);
  return t.item<float>() == pg.world_size() * (pg.world_size() - 1) / 2 ? 0 : 1;
}

TEST(Rendezvous, RanksJoinFromOpenMpiVariables) {
  lvx::testing::expect_all_ok(lvx::testing::run_ranks(3, "openmpi_join", 60, {}, true));
}
