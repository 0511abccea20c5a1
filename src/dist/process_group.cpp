// ProcessGroup's set-up on c10d engines: the rendezvous store, Gloo for CPU tensors and NCCL for
// CUDA ones (nccl_backend.cpp), groups adopted from torch.distributed and subgroups, and the
// byte counters. The point-to-point messages and their waits are process_group_p2p.cpp, the
// heartbeat and faults process_group_faults.cpp, the collectives collectives.cpp.
#include "src/dist/process_group.h"

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <optional>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "src/common/error.h"
#include "src/dist/nccl_backend.h"
#include "src/dist/process_group_state.h"

namespace lvx::dist {

int64_t ByteCounters::total_sent() const {
  return std::accumulate(sent.begin(), sent.end(), int64_t{0});
}
int64_t ByteCounters::sent_inter_node(int rank, int node_size) const {
  if (node_size <= 0) return 0;
  int64_t b = 0;
  for (size_t p = 0; p < sent.size(); ++p)
    if (static_cast<int>(p) / node_size != rank / node_size) b += sent[p];
  return b;
}
int64_t ByteCounters::total_received() const {
  return std::accumulate(received.begin(), received.end(), int64_t{0});
}
void ByteCounters::reset() {
  std::fill(sent.begin(), sent.end(), 0);
  std::fill(received.begin(), received.end(), 0);
  formula_sent = formula_received = 0;
  wait_seconds = 0;
}

Options options_from_env() {
  Options o;
  if (const char* t = std::getenv("LVX_DIST_TIMEOUT_S")) {
    double s = std::atof(t);
    LVX_CHECK(s > 0, "LVX_DIST_TIMEOUT_S='", t, "' must be a positive number of seconds");
    o.timeout = std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
    o.heartbeat = std::min(o.heartbeat, std::chrono::milliseconds(std::max<int64_t>(
                                            100, static_cast<int64_t>(s * 1000) / 5)));
  }
  if (const char* c = std::getenv("LVX_DIST_COLLECTIVES")) {
    const std::string v = c;
    LVX_CHECK(v == "auto" || v == "engine" || v == "p2p", "LVX_DIST_COLLECTIVES='", v,
              "' must be auto (the default: NCCL's collectives; on Gloo its allreduce and "
              "broadcast, lvx's rings for the rest), engine (the engines' own for every "
              "collective) or p2p (lvx's rings of point-to-point messages)");
    o.collectives = v == "p2p"      ? CollectiveImpl::kP2P
                    : v == "engine" ? CollectiveImpl::kEngine
                                    : CollectiveImpl::kAuto;
  }
  return o;
}

namespace {

c10::intrusive_ptr<c10d::TCPStore> connect_store(const RendezvousInfo& info, bool server,
                                                 std::chrono::milliseconds timeout) {
  c10d::TCPStoreOptions o;
  o.port = static_cast<uint16_t>(info.master_port);
  o.isServer = server;
  o.numWorkers = server ? std::optional<std::size_t>(info.world_size) : std::nullopt;
  o.waitWorkers = false;
  o.timeout = timeout;
  try {
    return c10::make_intrusive<c10d::TCPStore>(info.master_addr, o);
  } catch (const std::exception& e) {
    LVX_FAIL("rank ", info.rank, ": cannot ", server ? "host" : "reach",
             " the rendezvous store at ", info.master_addr, ":", info.master_port,
             " (MASTER_ADDR/MASTER_PORT",
             server ? "; is the port already in use?" : "; is rank 0 running?", "): ", e.what());
  }
}

// Gloo's options with this rank's devices: LVX_BIND_ADDRESS (an emulated cluster's node address,
// emulated_cluster.h), else the interface GLOO_SOCKET_IFNAME names, else loopback when the store
// is on this machine's loopback, else the address this host's name resolves to.
//
// Two devices, so two contexts: c10d picks a message's context by its tag (getContext: tag %
// contexts), and lvx's tags (gloo_tag) put each direction of a pair on its own context, hence on
// its own TCP connection and event loop. Over one connection Gloo moves a pair's two directions
// by turns: through an emulated 10 MB/s link an exchange ran at 5.0 MB/s each way (one way:
// 10.0), torch.distributed's own Gloo group likewise.
c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> gloo_options(
    const RendezvousInfo& info, std::chrono::milliseconds timeout) {
  auto o = c10d::ProcessGroupGloo::Options::create(timeout);
  const std::string& m = info.master_addr;
  for (int direction = 0; direction < 2; ++direction) {
    if (const char* addr = std::getenv("LVX_BIND_ADDRESS"); addr != nullptr && *addr != 0) {
      o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(addr));
    } else if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
      o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
    } else if (m.rfind("127.", 0) == 0 || m == "localhost") {
      o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
    } else {
      o->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
    }
  }
  return o;
}

// A connection of its own to `store` (one that never waits behind another's blocked
// operation), or the store itself where it cannot be cloned (in-process stores never block).
c10::intrusive_ptr<c10d::Store> own_connection(const c10::intrusive_ptr<c10d::Store>& store) {
  try {
    return store->clone();
  } catch (const std::exception&) {
    return store;
  }
}

// Gloo over `store` for rank `rank` of `info`'s group; `who` names the ranks in the error.
c10::intrusive_ptr<Backend> connect_gloo(const c10::intrusive_ptr<c10d::Store>& store,
                                         const RendezvousInfo& info, int rank,
                                         std::chrono::milliseconds timeout,
                                         const std::string& who) {
  try {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(store, info.rank, info.world_size,
                                                       gloo_options(info, timeout));
  } catch (const std::exception& e) {
    LVX_FAIL("rank ", rank, ": Gloo could not connect ", who, ": ", e.what());
  }
}

}  // namespace

ProcessGroup::ProcessGroup(const RendezvousInfo& info, Options options, bool connect)
    : info_(info),
      options_(options),
      rank_(info.rank),
      world_size_(info.world_size),
      handle_(std::make_shared<Handle>()) {
  handle_->pg = this;
  LVX_CHECK(world_size_ >= 1 && rank_ >= 0 && rank_ < world_size_, "invalid rank ", rank_,
            " for world size ", world_size_);
  counters_.sent.assign(world_size_, 0);
  counters_.received.assign(world_size_, 0);
  if (world_size_ == 1) return;  // a single rank needs no engine: every op is a local copy

  engine_ = std::make_unique<Engine>();
  engine_->send_seq.assign(world_size_, 0);
  engine_->recv_seq.assign(world_size_, 0);
  if (!connect) return;  // adopt() plugs in a torch.distributed group's engines
  engine_->store = connect_store(info_, rank_ == 0 && !info_.agent_store, options_.timeout);
  // Every rank announces itself, then waits for all: a missing rank fails here, by name.
  engine_->store->set(std::string(kStorePrefix) + "joined/" + std::to_string(rank_), kOne);
  for (int r = 0; r < world_size_; ++r) {
    try {
      engine_->store->wait({std::string(kStorePrefix) + "joined/" + std::to_string(r)},
                           options_.timeout);
    } catch (const std::exception&) {
      LVX_FAIL("rank ", rank_, ": rank ", r, " did not join the run within ",
               options_.timeout.count() / 1000.0, " s (WORLD_SIZE=", world_size_, ")");
    }
  }

  engine_->gloo = connect_gloo(c10::make_intrusive<c10d::PrefixStore>("lvx/gloo", engine_->store),
                               info_, rank_, options_.timeout, str("the ", world_size_, " ranks"));
  engine_->nccl = make_nccl_backend(engine_->store, info_, options_.timeout);
  engine_->cuda_via_host = true;  // used only when there is no NCCL engine (see stage_cuda)
  if (engine_->nccl && spans_nodes(info_)) {
    engine_->node_size = info_.local_world_size;
    engine_->nccl_inter =
        make_nccl_backend(engine_->store, info_, options_.timeout, "lvx/nccl-inter");
  }

  start_heartbeat();
}

c10::intrusive_ptr<c10d::Store> ProcessGroup::store_client(std::chrono::milliseconds timeout) {
  if (!engine_->adopted) return connect_store(info_, false, timeout);
  LVX_CHECK(engine_->store, "rank ", rank_, ": the torch.distributed group has no store");
  c10::intrusive_ptr<c10d::Store> s = own_connection(engine_->store);
  s->setTimeout(timeout);
  return s;
}

std::shared_ptr<ProcessGroup> ProcessGroup::adopt(const std::string& torch_group_name,
                                                  Options options) {
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  try {
    group = c10d::resolve_process_group(torch_group_name);
  } catch (const std::exception& e) {
    LVX_FAIL("no torch.distributed process group named '", torch_group_name,
             "' (call torch.distributed.init_process_group first): ", e.what());
  }
  RendezvousInfo info;
  info.rank = group->getRank();
  info.world_size = group->getSize();
  info.source = "torch.distributed group " + torch_group_name;
  // The launcher's node size describes the whole job; it applies to a group spanning it.
  const RendezvousInfo job = rendezvous_from_env();
  if (job.world_size == info.world_size) info.local_world_size = job.local_world_size;
  std::shared_ptr<ProcessGroup> pg(new ProcessGroup(info, options, /*connect=*/false));
  if (info.world_size == 1) return pg;
  auto& e = *pg->engine_;
  e.share_store();
  e.store = group->getStore();
  auto backend_for = [&](c10::DeviceType d) -> c10::intrusive_ptr<Backend> {
    try {
      return group->getBackend(d);
    } catch (const std::exception&) {
      return {};
    }
  };
  e.gloo = backend_for(c10::DeviceType::CPU);
  e.nccl = backend_for(c10::DeviceType::CUDA);
  LVX_CHECK(e.gloo || e.nccl, "torch.distributed group '", torch_group_name,
            "' has no backend for CPU or CUDA tensors");
  pg->start_heartbeat();
  return pg;
}

std::shared_ptr<ProcessGroup> ProcessGroup::subgroup(const std::shared_ptr<ProcessGroup>& parent,
                                                     int first, int size, const std::string& name) {
  const int pr = parent->rank();
  LVX_CHECK(first >= 0 && size >= 1 && first + size <= parent->world_size() && pr >= first &&
                pr < first + size,
            "subgroup: ranks [", first, ", ", first + size, ") of a world of ",
            parent->world_size(), " must include this rank ", pr);
  RendezvousInfo info = parent->info();
  info.rank = pr - first;
  info.world_size = size;
  info.source = str(parent->info().source, ", ranks ", first, "..", first + size - 1);
  // Ranks per node as the parent sees them, clipped to the group (a group inside a node).
  info.local_world_size = std::min(info.local_world_size, size);
  std::shared_ptr<ProcessGroup> pg(new ProcessGroup(info, parent->options_, /*connect=*/false));
  if (size == 1) return pg;
  LVX_CHECK(parent->engine_ && parent->engine_->store, "subgroup: the parent group has no store");
  auto& e = *pg->engine_;
  e.share_store();  // like an adopted group
  const std::string prefix =
      str(kStorePrefix, "sub/", first, "+", size, name.empty() ? "" : "/" + name, "/");
  e.store = c10::make_intrusive<c10d::PrefixStore>(prefix, own_connection(parent->engine_->store));
  e.gloo = connect_gloo(c10::make_intrusive<c10d::PrefixStore>("gloo", e.store), info, pr,
                        pg->options_.timeout,
                        str("the subgroup of ranks ", first, "..", first + size - 1));
  e.nccl = make_nccl_backend(e.store, info, pg->options_.timeout);
  e.cuda_via_host = true;
  pg->start_heartbeat();
  return pg;
}

std::shared_ptr<ProcessGroup> ProcessGroup::from_env(Options options) {
  return std::make_shared<ProcessGroup>(rendezvous_from_env(), options);
}

std::string ProcessGroup::cuda_engine() const {
  if (world_size_ == 1 || !engine_) return "none";
  if (engine_->nccl) return engine_->nccl_inter ? "nccl+inter" : "nccl";
  return "gloo-host-staged";
}

ByteCounters ProcessGroup::counters_snapshot() const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  return counters_;
}

void ProcessGroup::reset_counters() {
  std::lock_guard<std::mutex> lock(counters_mu_);
  counters_.reset();
}

}  // namespace lvx::dist
