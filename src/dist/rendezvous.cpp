#include "src/dist/rendezvous.h"

#include <cstdlib>

#include "src/common/error.h"

extern char** environ;

namespace lvx::dist {
namespace {

int parse_int(const std::map<std::string, std::string>& env, const std::string& key, int lo,
              int hi) {
  const std::string& v = env.at(key);
  size_t pos = 0;
  int x = 0;
  try {
    x = std::stoi(v, &pos);
  } catch (...) {
    pos = std::string::npos;
  }
  LVX_CHECK(pos == v.size(), "environment variable ", key, "='", v, "' is not an integer");
  LVX_CHECK(x >= lo && x <= hi, "environment variable ", key, "=", x, " is outside [", lo, ", ", hi,
            "]");
  return x;
}

// A task of an srun step (a batch script has SLURM_PROCID too, but no step).
bool slurm_step(const std::map<std::string, std::string>& env) {
  return env.count("SLURM_PROCID") && env.count("SLURM_STEP_ID") &&
         (env.count("SLURM_STEP_NUM_TASKS") || env.count("SLURM_NTASKS"));
}

void read_slurm(const std::map<std::string, std::string>& env, RendezvousInfo& info) {
  info.source = "slurm";
  const char* tasks = env.count("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  info.world_size = parse_int(env, tasks, 1, 1 << 20);
  info.rank = parse_int(env, "SLURM_PROCID", 0, info.world_size - 1);
  info.local_rank = env.count("SLURM_LOCALID")
                        ? parse_int(env, "SLURM_LOCALID", 0, info.world_size - 1)
                        : info.rank;
  info.local_world_size = info.world_size;
  if (env.count("SLURM_STEP_TASKS_PER_NODE") && env.count("SLURM_NODEID")) {
    const int node = parse_int(env, "SLURM_NODEID", 0, 1 << 20);
    info.local_world_size = slurm_tasks_on_node(env.at("SLURM_STEP_TASKS_PER_NODE"), node);
  }
  for (const char* list : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"})
    if (env.count(list)) {
      info.master_addr = first_slurm_host(env.at(list));
      break;
    }
}

}  // namespace

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry: up to a comma outside brackets; a bracket range gives its first number.
  const size_t bracket = nodelist.find('['), comma = nodelist.find(',');
  if (bracket == std::string::npos || (comma != std::string::npos && comma < bracket))
    return nodelist.substr(0, comma);
  const size_t end = nodelist.find_first_of(",-]", bracket + 1);
  LVX_CHECK(end != std::string::npos, "Slurm node list '", nodelist, "': an unclosed '['");
  return nodelist.substr(0, bracket) + nodelist.substr(bracket + 1, end - bracket - 1);
}

int slurm_tasks_on_node(const std::string& tasks_per_node, int node) {
  // "8(x2),4": counts, each repeated (xN) times, in node order.
  size_t at = 0;
  int seen = 0;
  while (at < tasks_per_node.size()) {
    size_t next = tasks_per_node.find(',', at);
    if (next == std::string::npos) next = tasks_per_node.size();
    const std::string item = tasks_per_node.substr(at, next - at);
    const size_t x = item.find("(x");
    const int count = std::atoi(item.substr(0, x).c_str());
    const int times = x == std::string::npos ? 1 : std::atoi(item.c_str() + x + 2);
    LVX_CHECK(count > 0 && times > 0, "SLURM_STEP_TASKS_PER_NODE='", tasks_per_node,
              "': cannot read '", item, "'");
    if (node < seen + times) return count;
    seen += times;
    at = next + 1;
  }
  LVX_CHECK(false, "SLURM_STEP_TASKS_PER_NODE='", tasks_per_node, "' lists ", seen,
            " nodes, not node ", node);
  return 0;
}

RendezvousInfo rendezvous_from_env(const std::map<std::string, std::string>& env) {
  RendezvousInfo info;
  auto has = [&](const char* k) { return env.count(k) > 0; };
  if (has("RANK") || has("WORLD_SIZE")) {
    LVX_CHECK(has("RANK") && has("WORLD_SIZE"),
              "torchrun-style launch needs both RANK and WORLD_SIZE (only ",
              has("RANK") ? "RANK" : "WORLD_SIZE", " is set)");
    info.source = "torchrun";
    info.world_size = parse_int(env, "WORLD_SIZE", 1, 1 << 20);
    info.rank = parse_int(env, "RANK", 0, info.world_size - 1);
    info.local_rank =
        has("LOCAL_RANK") ? parse_int(env, "LOCAL_RANK", 0, info.world_size - 1) : info.rank;
    info.local_world_size = has("LOCAL_WORLD_SIZE")
                                ? parse_int(env, "LOCAL_WORLD_SIZE", 1, info.world_size)
                                : info.world_size;
  } else if (has("OMPI_COMM_WORLD_RANK") || has("OMPI_COMM_WORLD_SIZE")) {
    LVX_CHECK(has("OMPI_COMM_WORLD_RANK") && has("OMPI_COMM_WORLD_SIZE"),
              "OpenMPI launch needs OMPI_COMM_WORLD_RANK and OMPI_COMM_WORLD_SIZE");
    info.source = "openmpi";
    info.world_size = parse_int(env, "OMPI_COMM_WORLD_SIZE", 1, 1 << 20);
    info.rank = parse_int(env, "OMPI_COMM_WORLD_RANK", 0, info.world_size - 1);
    info.local_rank = has("OMPI_COMM_WORLD_LOCAL_RANK")
                          ? parse_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0, info.world_size - 1)
                          : info.rank;
    info.local_world_size = has("OMPI_COMM_WORLD_LOCAL_SIZE")
                                ? parse_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, info.world_size)
                                : info.world_size;
  } else if (slurm_step(env)) {
    read_slurm(env, info);
  }
  if (has("MASTER_ADDR")) info.master_addr = env.at("MASTER_ADDR");
  if (has("MASTER_PORT")) info.master_port = parse_int(env, "MASTER_PORT", 1, 65535);
  info.agent_store =
      has("TORCHELASTIC_USE_AGENT_STORE") && env.at("TORCHELASTIC_USE_AGENT_STORE") == "True";
  return info;
}

namespace {

std::map<std::string, std::string> process_env() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

}  // namespace

RendezvousInfo rendezvous_from_env() { return rendezvous_from_env(process_env()); }

bool launched_as_rank() {
  if (std::getenv("WORLD_SIZE") || std::getenv("OMPI_COMM_WORLD_SIZE")) return true;
  return slurm_step(process_env());
}

}  // namespace lvx::dist
