// ProcessGroup on c10d engines: Gloo for CPU tensors, NCCL for CUDA tensors (nccl_backend.cpp):
// set-up, point-to-point messages (counted per peer as they complete), waiting and faults; the
// collectives are collectives.cpp. Faults fail the whole group: the first failed request aborts
// every other pending one (c10d Work::abort), so a rank never waits a second timeout while
// unwinding past requests it still had in flight.
// Over 600 lines: set-up, messages, waits and faults share the engine state and its locks; the split
// along those lines is issue 33 (structure), done last so as not to collide with the others.
#include "src/dist/process_group.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>
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

const char* kStorePrefix = "lvx/";
const std::vector<uint8_t> kOne{1};  // a store flag

}  // namespace

// ---- engine ------------------------------------------------------------------------------

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
    LVX_FAIL("rank ", info.rank, ": cannot ", server ? "host" : "reach", " the rendezvous store at ",
             info.master_addr, ":", info.master_port, " (MASTER_ADDR/MASTER_PORT",
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
c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> gloo_options(const RendezvousInfo& info,
                                                                 std::chrono::milliseconds timeout) {
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

// The Gloo tag of message number `seq` from rank `from` to rank `to` (both sides compute the same):
// its low bit is the direction, so that each direction has a context of its own (gloo_options).
int gloo_tag(uint32_t base, uint32_t mask, uint32_t seq, int from, int to) {
  return static_cast<int>(base | (((seq << 1) | (from < to ? 0u : 1u)) & mask));
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
  engine_->store = connect_store(info_, rank_ == 0, options_.timeout);
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

  auto gloo_opts = gloo_options(info_, options_.timeout);
  auto gloo_store = c10::make_intrusive<c10d::PrefixStore>("lvx/gloo", engine_->store);
  try {
    engine_->gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(gloo_store, rank_, world_size_,
                                                                gloo_opts);
  } catch (const std::exception& e) {
    LVX_FAIL("rank ", rank_, ": Gloo could not connect the ", world_size_, " ranks: ", e.what());
  }
  engine_->nccl = make_nccl_backend(engine_->store, info_, options_.timeout);
  engine_->cuda_via_host = true;  // used only when there is no NCCL engine (see stage_cuda)
  if (engine_->nccl && spans_nodes(info_)) {
    engine_->node_size = info_.local_world_size;
    engine_->nccl_inter = make_nccl_backend(engine_->store, info_, options_.timeout,
                                            "lvx/nccl-inter");
  }

  start_heartbeat();
}

c10::intrusive_ptr<c10d::Store> ProcessGroup::store_client(std::chrono::milliseconds timeout) {
  if (!engine_->adopted) return connect_store(info_, false, timeout);
  LVX_CHECK(engine_->store, "rank ", rank_, ": the torch.distributed group has no store");
  c10::intrusive_ptr<c10d::Store> s;
  try {
    s = engine_->store->clone();  // its own connection: never waits behind a blocked operation
  } catch (const std::exception&) {
    s = engine_->store;  // stores that cannot be cloned (in-process ones) never block anyway
  }
  s->setTimeout(timeout);
  return s;
}

void ProcessGroup::start_heartbeat() {
  // Heartbeat on its own store connection so that it never waits behind a blocked operation.
  c10::intrusive_ptr<c10d::Store> hb_store;
  try {
    // The group's timeout, not a shorter one: under load (2 cores, 8 ranks of two runs) rank 0's
    // store took over 5 s to accept this second connection, and the rank failed at start.
    hb_store = store_client(options_.timeout);
  } catch (const std::exception&) {
    if (!engine_->adopted) throw;
    return;  // an adopted group without a usable store: failures are still bounded, not named
  }
  Engine* eng = engine_.get();
  const auto period = options_.heartbeat;
  const std::string key = std::string(kStorePrefix) + "hb/" + std::to_string(rank_);
  eng->heartbeat = std::thread([eng, hb_store, period, key] {
    std::unique_lock<std::mutex> lock(eng->mu);
    while (!eng->stopping) {
      lock.unlock();
      try {
        hb_store->add(key, 1);
      } catch (...) {
        return;  // the store is gone (rank 0 ended); failures are diagnosed elsewhere
      }
      lock.lock();
      eng->cv.wait_for(lock, period, [eng] { return eng->stopping; });
    }
  });
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
  e.adopted = true;
  e.tag_base = 1u << 30;
  e.tag_mask = (1u << 30) - 1;
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
  // Like an adopted group: the (prefixed) store is shared, never hosted; tags from 2^30 up.
  e.adopted = true;
  e.tag_base = 1u << 30;
  e.tag_mask = (1u << 30) - 1;
  const std::string prefix =
      str(kStorePrefix, "sub/", first, "+", size, name.empty() ? "" : "/" + name, "/");
  c10::intrusive_ptr<c10d::Store> base;
  try {
    base = parent->engine_->store->clone();
  } catch (const std::exception&) {
    base = parent->engine_->store;
  }
  e.store = c10::make_intrusive<c10d::PrefixStore>(prefix, base);
  auto gloo_opts = gloo_options(info, pg->options_.timeout);
  try {
    e.gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>("gloo", e.store), info.rank, size, gloo_opts);
  } catch (const std::exception& ex) {
    LVX_FAIL("rank ", pr, ": Gloo could not connect the subgroup of ranks ", first, "..",
             first + size - 1, ": ", ex.what());
  }
  e.nccl = make_nccl_backend(e.store, info, pg->options_.timeout);
  e.cuda_via_host = true;
  pg->start_heartbeat();
  return pg;
}

std::shared_ptr<ProcessGroup> ProcessGroup::from_env(Options options) {
  return std::make_shared<ProcessGroup>(rendezvous_from_env(), options);
}

ProcessGroup::~ProcessGroup() {
  {
    // Works that outlive the group now fail to wait instead of touching it; a wait already
    // running on another thread ends first (within the timeout).
    std::unique_lock<std::mutex> lock(handle_->mu);
    handle_->pg = nullptr;
    handle_->cv.wait(lock, [this] { return handle_->waiting == 0; });
  }
  if (!engine_) return;
  {
    std::lock_guard<std::mutex> lock(engine_->mu);
    engine_->stopping = true;
  }
  engine_->cv.notify_all();
  if (engine_->heartbeat.joinable()) engine_->heartbeat.join();
  const std::string p = kStorePrefix;
  try {
    engine_->store->set(p + "exit/" + std::to_string(rank_), kOne);
    engine_->store->set(p + "done/" + std::to_string(rank_), kOne);
  } catch (...) {
  }
  // Rank 0 hosts the store, and its exit takes the store down. After a failure the other ranks
  // still need it to diagnose theirs (whose heartbeat stopped?), and a rank that loses the store
  // mid-diagnosis can only say "rank 0 likely ended", hiding the rank that really failed. So the
  // host lingers until every peer it did not find dead has ended or finished its diagnosis
  // (`done/<r>`), one that stops heartbeating meanwhile counts as dead; bounded by one timeout
  // plus a diagnosis.
  if (rank_ == 0 && !engine_->adopted && !failure().empty()) linger_for_peers();
}

void ProcessGroup::linger_for_peers() {
  const std::string p = kStorePrefix;
  std::vector<int> found_dead;
  {
    std::lock_guard<std::mutex> lock(engine_->fault_mu);
    found_dead = engine_->found_dead;
  }
  using clock = std::chrono::steady_clock;
  struct Peer {
    int rank;
    int64_t hb;
    clock::time_point hb_changed;
  };
  const auto start = clock::now();
  const auto deadline = start + options_.timeout + options_.heartbeat * 3;
  const auto silence = options_.heartbeat * 5 / 2;
  try {
    std::vector<Peer> waiting;
    for (int r = 1; r < world_size_; ++r)
      if (std::find(found_dead.begin(), found_dead.end(), r) == found_dead.end())
        waiting.push_back({r, engine_->store->add(p + "hb/" + std::to_string(r), 0), start});
    while (!waiting.empty() && clock::now() < deadline) {
      const auto now = clock::now();
      std::vector<Peer> still;
      for (Peer w : waiting) {
        if (engine_->store->check({p + "done/" + std::to_string(w.rank)})) continue;
        const int64_t hb = engine_->store->add(p + "hb/" + std::to_string(w.rank), 0);
        if (hb != w.hb) {
          w.hb = hb;
          w.hb_changed = now;
        } else if (now - w.hb_changed > silence) {
          continue;  // stopped heartbeating: dead or frozen, nothing to wait for
        }
        still.push_back(w);
      }
      waiting.swap(still);
      if (!waiting.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (...) {
  }
}

std::string ProcessGroup::cuda_engine() const {
  if (world_size_ == 1 || !engine_) return "none";
  if (engine_->nccl) return engine_->nccl_inter ? "nccl+inter" : "nccl";
  return "gloo-host-staged";
}

std::string ProcessGroup::failure() const {
  if (!engine_) return {};
  std::lock_guard<std::mutex> lock(engine_->fault_mu);
  return engine_->failure;
}

void ProcessGroup::check_not_failed(const std::string& what) const {
  const std::string first = failure();
  if (!first.empty())
    LVX_FAIL("rank ", rank_, ": ", what,
             " aborted: an earlier operation of this process group failed (", first, ")");
}

void ProcessGroup::abort_pending() {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  {
    std::lock_guard<std::mutex> lock(engine_->fault_mu);
    for (auto& [ptr, w] : engine_->pending) works.push_back(w);
    engine_->pending.clear();
    engine_->aborted.insert(engine_->aborted.end(), works.begin(), works.end());
  }
  // Gloo: wakes any waiter, whose wait() then returns false; NCCL: aborts the communicator.
  for (auto& w : works) {
    try {
      w->abort();
    } catch (...) {
    }
  }
}

void ProcessGroup::fail(const std::string& what, const std::string& cause) {
  if (!engine_) LVX_FAIL("rank ", rank_, ": ", what, " failed: ", cause);
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(engine_->fault_mu);
    first = engine_->failure.empty();
    if (first) engine_->failure = str(what, " failed: ", cause);  // refined after the diagnosis
  }
  if (!first) check_not_failed(what);  // another thread's request failed first: report that one
  // Fail fast: nothing else of this group may wait a timeout for a peer that is gone.
  abort_pending();
  std::string diagnosis;
  {
    const std::string p = kStorePrefix;
    try {
      // Mark ourselves as exiting on an error, so that other ranks do not blame us.
      auto store = store_client(std::chrono::milliseconds(3000));
      store->set(p + "exit/" + std::to_string(rank_), kOne);
      std::vector<int64_t> before(world_size_), after(world_size_);
      for (int r = 0; r < world_size_; ++r) before[r] = store->add(p + "hb/" + std::to_string(r), 0);
      std::this_thread::sleep_for(options_.heartbeat * 5 / 2);
      std::vector<int> dead;
      for (int r = 0; r < world_size_; ++r) {
        if (r == rank_) continue;
        after[r] = store->add(p + "hb/" + std::to_string(r), 0);
        bool exited = store->check({p + "exit/" + std::to_string(r)});
        if (after[r] == before[r] && !exited) dead.push_back(r);
      }
      for (int r : dead)
        diagnosis += str(diagnosis.empty() ? "" : "; ", "rank ", r,
                         " stopped responding (no heartbeat for ",
                         options_.heartbeat.count() * 2.5 / 1000.0, " s)");
      if (dead.empty()) diagnosis = "another rank ended after an error";
      {
        std::lock_guard<std::mutex> lock(engine_->fault_mu);
        engine_->found_dead = dead;
      }
      store->set(p + "done/" + std::to_string(rank_), kOne);  // the store host may now go
    } catch (const lvx::Error&) {
      diagnosis = str("rank 0 (which hosts the rendezvous store at ", info_.master_addr, ":",
                      info_.master_port, ") stopped responding");
    } catch (const std::exception&) {
      diagnosis = engine_->adopted
                      ? "the torch.distributed group's store became unreachable"
                      : "the rendezvous store became unreachable (rank 0 likely ended)";
    }
  }
  const std::string msg = str("rank ", rank_, ": ", what, " failed: ", diagnosis,
                              diagnosis.empty() ? "" : " — ", "engine error: ", cause);
  {
    std::lock_guard<std::mutex> lock(engine_->fault_mu);
    engine_->failure = msg;
  }
  LVX_FAIL(msg);
}

// ---- Work --------------------------------------------------------------------------------

Work::Work() = default;
Work::Work(Work&&) noexcept = default;

Work& Work::operator=(Work&& other) noexcept {
  if (this != &other) {
    if (impl_ && !impl_->done) {
      try {
        wait();
      } catch (...) {
      }
    }
    impl_ = std::move(other.impl_);
  }
  return *this;
}

Work::~Work() {
  if (impl_ && !impl_->done) {
    try {
      wait();  // returns at once when the group has failed
    } catch (...) {
      // A destructor must not throw. A failure found here still fails the group, so the next
      // operation reports it.
    }
  }
}

void Work::wait() {
  if (!impl_ || impl_->done) return;
  impl_->done = true;
  ProcessGroup::Handle& h = *impl_->group;
  ProcessGroup* pg = nullptr;
  {
    std::lock_guard<std::mutex> lock(h.mu);
    pg = h.pg;
    if (pg != nullptr) ++h.waiting;
  }
  if (pg == nullptr) {
    impl_->posted.clear();  // abandoned: never counted
    LVX_FAIL(impl_->what,
             ": waited for after its process group was destroyed (a Work must not outlive its "
             "ProcessGroup); its messages are abandoned");
  }
  struct Leave {
    ProcessGroup::Handle& h;
    ~Leave() {
      {
        std::lock_guard<std::mutex> lock(h.mu);
        --h.waiting;
      }
      h.cv.notify_all();
    }
  } leave{h};
  pg->wait_work(*impl_);
}

ByteCounters ProcessGroup::counters_snapshot() const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  return counters_;
}

void ProcessGroup::reset_counters() {
  std::lock_guard<std::mutex> lock(counters_mu_);
  counters_.reset();
}

void ProcessGroup::wait_work(Work::Impl& w) {
  const auto t0 = std::chrono::steady_clock::now();
  struct AddWait {  // counted on every path out, errors included
    ProcessGroup& pg;
    std::chrono::steady_clock::time_point t0;
    ~AddWait() {
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::lock_guard<std::mutex> lock(pg.counters_mu_);
      pg.counters_.wait_seconds += s;
    }
  } add_wait{*this, t0};
  for (auto& p : w.posted) {
    check_not_failed(w.what);  // its requests were aborted: do not wait for them
    bool completed = false;
    try {
      if (p.stream_ordered) {
        nccl_stream_wait(*p.work);  // no host block: the current stream waits on NCCL's
        completed = true;
      } else {
        completed = p.work->wait(w.timeout);
      }
    } catch (const c10::Error& e) {
      fail(w.what, e.what_without_backtrace());
    } catch (const std::exception& e) {
      fail(w.what, e.what());
    }
    if (!completed) {  // aborted while waiting: another request (thread) failed the group
      check_not_failed(w.what);
      fail(w.what, "the request was aborted");
    }
    {
      std::lock_guard<std::mutex> lock(engine_->fault_mu);
      engine_->pending.erase(p.work.get());
    }
    if (p.device.defined()) p.device.copy_(p.staged);
    {
      std::lock_guard<std::mutex> lock(counters_mu_);
      for (const auto& m : p.msgs) {
        (m.kind == P2POp::kSend ? counters_.sent : counters_.received)[m.peer] += m.bytes;
        if (p.formula) (m.kind == P2POp::kSend ? counters_.formula_sent : counters_.formula_received) += m.bytes;
      }
    }
  }
  w.posted.clear();
}

// ---- point to point ----------------------------------------------------------------------

Work ProcessGroup::batch_isend_irecv(std::vector<P2POp> ops, const char* what) {
  Work work;
  work.impl_ = std::make_unique<Work::Impl>();
  work.impl_->group = handle_;
  work.impl_->timeout = options_.timeout;
  std::vector<int> peers;
  for (const auto& op : ops) {
    LVX_CHECK(op.peer >= 0 && op.peer < world_size_, what, ": peer ", op.peer,
              " is outside [0, ", world_size_, ")");
    LVX_CHECK(op.peer != rank_, what, ": rank ", rank_, " cannot send to or receive from itself");
    LVX_CHECK(op.tensor.is_contiguous(), what, ": tensors must be contiguous");
    peers.push_back(op.peer);
  }
  std::sort(peers.begin(), peers.end());
  peers.erase(std::unique(peers.begin(), peers.end()), peers.end());
  std::string peer_list;
  for (int p : peers) peer_list += str(peer_list.empty() ? "" : ",", p);
  work.impl_->what = str(what, " with rank", peers.size() > 1 ? "s " : " ", peer_list);
  if (ops.empty()) return work;
  check_not_failed(work.impl_->what);

  bool any_cuda = false, any_cpu = false;
  for (const auto& op : ops) (op.tensor.is_cuda() ? any_cuda : any_cpu) = true;
  LVX_CHECK(!(any_cuda && any_cpu), what, ": a batch mixes CPU and CUDA tensors");
  // Host staging (Engine::stage_cuda): the batch becomes a Gloo batch of host tensors.
  std::map<const at::TensorImpl*, at::Tensor> staged_recv;  // host buffer -> device tensor
  if (any_cuda && engine_->stage_cuda()) {
    for (auto& op : ops) {
      if (op.kind == P2POp::kSend) {
        op.tensor = op.tensor.to(at::kCPU);  // synchronous: the data is on the host when it returns
      } else {
        at::Tensor host = at::empty(op.tensor.sizes(), op.tensor.options().device(at::kCPU));
        staged_recv[host.unsafeGetTensorImpl()] = op.tensor;
        op.tensor = host;
      }
    }
    any_cuda = false;
  }
  Backend& backend = engine_->backend_for(ops.front().tensor);
  const bool coalesce = any_cuda;  // NCCL: one group call; Gloo: unbound buffers never block
  auto& posted = work.impl_->posted;
  auto track = [&](c10::intrusive_ptr<c10d::Work> w, std::vector<Work::Impl::Msg> msgs) {
    std::lock_guard<std::mutex> lock(engine_->fault_mu);
    engine_->pending[w.get()] = w;
    posted.push_back({std::move(w), std::move(msgs), /*stream_ordered=*/any_cuda, {}, {}});
  };
  // NCCL in a multi-node run: the batch's inter-node messages form a second group call on the
  // inter-node communicator (a pair is inter-node on both sides alike, so both post it there).
  Backend* inter = nullptr;
  std::vector<P2POp> inter_ops;
  if (any_cuda && engine_->nccl_inter) {
    inter = engine_->nccl_inter.get();
    const int node = rank_ / engine_->node_size;
    std::vector<P2POp> intra_ops;
    for (auto& op : ops)
      (op.peer / engine_->node_size == node ? intra_ops : inter_ops).push_back(std::move(op));
    ops = std::move(intra_ops);
  }
  // An engine error while posting fails the group, after post_mu is released (the diagnosis
  // takes seconds, and other threads must see the failure rather than wait behind it).
  std::optional<std::string> engine_error;
  {
    std::lock_guard<std::mutex> post_lock(engine_->post_mu);
    try {
      auto post = [&](Backend& engine, std::vector<P2POp>& batch) {
        bool any = false;
        for (const auto& op : batch) any = any || nbytes(op.tensor) > 0;
        if (!any) return;
        if (coalesce) engine.startCoalescing();
        std::vector<Work::Impl::Msg> coalesced;
        for (auto& op : batch) {
          const int64_t n = nbytes(op.tensor);
          if (n == 0) continue;
          std::vector<at::Tensor> ts{op.tensor};
          auto& seq = op.kind == P2POp::kSend ? engine_->send_seq : engine_->recv_seq;
          const bool send = op.kind == P2POp::kSend;
          const int tag = gloo_tag(engine_->tag_base, engine_->tag_mask, seq[op.peer]++,
                                   send ? rank_ : op.peer, send ? op.peer : rank_);
          auto w = op.kind == P2POp::kSend ? engine.send(ts, op.peer, tag)
                                           : engine.recv(ts, op.peer, tag);
          if (coalesce) {
            coalesced.push_back({op.kind, op.peer, n});
          } else {
            track(w, {{op.kind, op.peer, n}});
            auto it = staged_recv.find(op.tensor.unsafeGetTensorImpl());
            if (it != staged_recv.end()) {
              posted.back().staged = op.tensor;
              posted.back().device = it->second;
            }
          }
        }
        if (coalesce) {
          auto w = engine.endCoalescing();
          if (w) track(w, std::move(coalesced));
        }
      };
      post(backend, ops);
      if (inter) post(*inter, inter_ops);
    } catch (const lvx::Error&) {
      throw;
    } catch (const c10::Error& e) {
      engine_error = e.what_without_backtrace();
    } catch (const std::exception& e) {
      engine_error = e.what();
    }
  }
  if (engine_error) fail(work.impl_->what, *engine_error);
  return work;
}

Work ProcessGroup::ring_exchange(const at::Tensor& send, const at::Tensor& recv,
                                 const char* what) {
  if (world_size_ == 1) {
    if (recv.numel()) recv.copy_(send);
    return Work();
  }
  return batch_isend_irecv({P2POp::send(send, next()), P2POp::recv(recv, prev())}, what);
}

void ProcessGroup::barrier() {
  if (world_size_ == 1) return;
  check_not_failed("barrier");
  try {
    c10d::BarrierOptions o;
    o.timeout = options_.timeout;
    engine_->gloo->barrier(o)->wait(options_.timeout);
  } catch (const c10::Error& e) {
    fail("barrier", e.what_without_backtrace());
  } catch (const std::exception& e) {
    fail("barrier", e.what());
  }
}

void ProcessGroup::check_agreement(const std::string& what, const std::string& value) {
  if (world_size_ == 1) return;
  check_not_failed(str("check_agreement(", what, ")"));
  const std::string base =
      str(kStorePrefix, "agree/", engine_->agreement_seq++, "/", what, "/");
  std::vector<std::string> values(world_size_);
  try {
    engine_->store->set(base + std::to_string(rank_),
                        std::vector<uint8_t>(value.begin(), value.end()));
    for (int r = 0; r < world_size_; ++r) {
      auto v = engine_->store->get(base + std::to_string(r));
      values[r] = std::string(v.begin(), v.end());
    }
  } catch (const std::exception& e) {
    fail(str("check_agreement(", what, ")"), e.what());
  }
  std::map<std::string, std::vector<int>> groups;
  for (int r = 0; r < world_size_; ++r) groups[values[r]].push_back(r);
  if (groups.size() == 1) return;
  std::string msg;
  for (const auto& [v, ranks] : groups) {
    std::string rl;
    for (int r : ranks) rl += str(rl.empty() ? "" : ",", r);
    msg += str("\n  rank", ranks.size() > 1 ? "s " : " ", rl, ": ", v);
  }
  LVX_FAIL("rank ", rank_, ": ranks disagree on ", what, " before starting:", msg);
}

std::vector<std::string> gather_errors(ProcessGroup& pg, const std::string& error) {
  const int n = pg.world_size();
  if (n == 1) return {error};
  at::Tensor flags = at::zeros({n}, at::kLong);
  if (!error.empty()) flags[pg.rank()] = 1;
  pg.all_reduce(flags);
  std::vector<std::string> out(static_cast<size_t>(n));
  if (flags.sum().item<int64_t>() == 0) return out;
  constexpr int64_t kLen = 2048;
  at::Tensor mine = at::zeros({1, kLen}, at::kByte);
  std::memcpy(mine.data_ptr(), error.data(), std::min<size_t>(error.size(), kLen - 1));
  const at::Tensor all = pg.all_gather(mine).contiguous();
  for (int r = 0; r < n; ++r) {
    if (flags[r].item<int64_t>() == 0) continue;
    const char* text = reinterpret_cast<const char*>(all[r].data_ptr());
    out[static_cast<size_t>(r)] = std::string(text, ::strnlen(text, kLen));
  }
  return out;
}


}  // namespace lvx::dist
