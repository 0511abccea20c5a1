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
  LVX_CHECK(x >= lo && x <= hi, "environment variable ", key, "=", x, " is outside [", lo, ", ",
            hi, "]");
  return x;
}

}  // namespace

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
    info.local_rank = has("LOCAL_RANK") ? parse_int(env, "LOCAL_RANK", 0, info.world_size - 1)
                                        : info.rank;
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
  }
  if (has("MASTER_ADDR")) info.master_addr = env.at("MASTER_ADDR");
  if (has("MASTER_PORT")) info.master_port = parse_int(env, "MASTER_PORT", 1, 65535);
  info.agent_store =
      has("TORCHELASTIC_USE_AGENT_STORE") && env.at("TORCHELASTIC_USE_AGENT_STORE") == "True";
  return info;
}

RendezvousInfo rendezvous_from_env() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return rendezvous_from_env(env);
}

}  // namespace lvx::dist
