// Where this process sits in a distributed run, read the way the ecosystem sets it:
// torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT first, then
// OpenMPI's OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE (MASTER_ADDR/PORT still name the
// rendezvous store, default 127.0.0.1:29500). No variables at all means a single rank.
// Rank 0 hosts the store unless the launcher already does (TORCHELASTIC_USE_AGENT_STORE=True, as
// torchrun and lvx launch without --master-port set it, and as torch.distributed reads it).
#pragma once

#include <map>
#include <string>

namespace lvx::dist {

struct RendezvousInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  std::string source = "default";  // "torchrun", "openmpi" or "default"
  bool agent_store = false;        // torchrun's agent hosts the store: every rank is a client
};

// Reads the variables from `env` (tests pass a map; the default reads the process environment).
// Throws lvx::Error naming the variable when one is malformed or out of range.
RendezvousInfo rendezvous_from_env(const std::map<std::string, std::string>& env);
RendezvousInfo rendezvous_from_env();

}  // namespace lvx::dist
