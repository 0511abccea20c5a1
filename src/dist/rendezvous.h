// Where this process sits in a distributed run, read the way the ecosystem sets it:
// torchrun's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT first, then
// OpenMPI's OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE (MASTER_ADDR/PORT still name the
// rendezvous store, default 127.0.0.1:29500), then Slurm's for a task of an srun step
// (SLURM_STEP_ID set): SLURM_PROCID, SLURM_STEP_NUM_TASKS (or SLURM_NTASKS), SLURM_LOCALID, the
// node's count in SLURM_STEP_TASKS_PER_NODE, and MASTER_ADDR or else the first host of
// SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST), as torchrun and PyTorch Lightning read them. A
// batch script itself (SLURM_PROCID without a step) is no rank. No variables at all means a
// single rank.
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
  std::string source = "default";  // "torchrun", "openmpi", "slurm" or "default"
  bool agent_store = false;        // torchrun's agent hosts the store: every rank is a client
};

// Reads the variables from `env` (tests pass a map; the default reads the process environment).
// Throws lvx::Error naming the variable when one is malformed or out of range.
RendezvousInfo rendezvous_from_env(const std::map<std::string, std::string>& env);
RendezvousInfo rendezvous_from_env();

// Whether this process is one rank of a launched run (torchrun's WORLD_SIZE, OpenMPI's
// OMPI_COMM_WORLD_SIZE, or a task of an srun step): a command then runs its rank's part.
bool launched_as_rank();

// Slurm's compressed host lists and task counts: the first host of "gpu[07-08,12],cpu3"
// ("gpu07"), and node `node`'s tasks in "8(x2),4" (8, 8, then 4).
std::string first_slurm_host(const std::string& nodelist);
int slurm_tasks_on_node(const std::string& tasks_per_node, int node);

}  // namespace lvx::dist
