// ProcessGroup's health and faults: the heartbeat each rank keeps in the store, the failure that
// fails the whole group (the first failed request aborts every other pending one, c10d
// Work::abort, so a rank never waits a second timeout while unwinding past requests it still had
// in flight; the store's heartbeats then name the rank that stopped), the store host that
// lingers for its peers' diagnoses, and the checks that ranks agree (check_agreement,
// gather_errors, barrier).
#include <algorithm>
#include <cstring>
#include <map>
#include <thread>

#include "src/common/error.h"
#include "src/dist/process_group.h"
#include "src/dist/process_group_state.h"

namespace lvx::dist {

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
      for (int r = 0; r < world_size_; ++r)
        before[r] = store->add(p + "hb/" + std::to_string(r), 0);
      std::this_thread::sleep_for(options_.heartbeat * 5 / 2);
      std::vector<int> dead;
      for (int r = 0; r < world_size_; ++r) {
        if (r == rank_) continue;
        after[r] = store->add(p + "hb/" + std::to_string(r), 0);
        bool exited = store->check({p + "exit/" + std::to_string(r)});
        if (after[r] == before[r] && !exited) dead.push_back(r);
      }
      for (int r : dead)
        diagnosis +=
            str(diagnosis.empty() ? "" : "; ", "rank ", r, " stopped responding (no heartbeat for ",
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
  const std::string base = str(kStorePrefix, "agree/", engine_->agreement_seq++, "/", what, "/");
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
