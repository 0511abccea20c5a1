// Internal to src/dist/: the state behind ProcessGroup and Work, shared by the files that
// implement them (process_group.cpp: set-up; process_group_p2p.cpp: point to point and waits;
// process_group_faults.cpp: heartbeat and faults; collectives.cpp: the collectives on the engines'
// own algorithms).
#pragma once

#include <atomic>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <vector>

#include "src/common/error.h"
#include "src/dist/process_group.h"

namespace lvx::dist {

using c10d::Backend;

// The rendezvous store's keys of lvx (joined/, hb/, exit/, done/, agree/, sub/) and a flag value.
inline constexpr const char* kStorePrefix = "lvx/";
inline const std::vector<uint8_t> kOne{1};

// Runs `post` (calls into an engine); the engine's exception becomes its message, for the caller
// to fail the group with once its locks are released (lvx's own errors pass through).
template <typename F>
std::optional<std::string> engine_error_of(F&& post) {
  try {
    post();
  } catch (const lvx::Error&) {
    throw;
  } catch (const c10::Error& e) {
    return std::string(e.what_without_backtrace());
  } catch (const std::exception& e) {
    return std::string(e.what());
  }
  return std::nullopt;
}

inline int64_t nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// What a Work holds of its group: the group while it lives. ~ProcessGroup clears `pg` (no new
// wait starts) and waits for the waits in progress (`waiting`) to end.
struct ProcessGroup::Handle {
  std::mutex mu;
  std::condition_variable cv;
  ProcessGroup* pg = nullptr;
  int waiting = 0;
};

struct ProcessGroup::Engine {
  // Owned groups: the TCP store rank 0 hosts. Adopted torch.distributed groups: that group's
  // store (its own prefix), when it has one.
  c10::intrusive_ptr<c10d::Store> store;
  bool adopted = false;  // the engines belong to a torch.distributed group (ProcessGroup::adopt)
  // Gloo tags of lvx's messages: per-peer sequence numbers, from 2^30 up in an adopted group so
  // that they never match the tags of the user's own torch.distributed send/recv (small numbers).
  uint32_t tag_base = 0, tag_mask = 0x7fffffff;
  // An adopted or sub group: its store is shared, never hosted, and its tags start at 2^30.
  void share_store() {
    adopted = true;
    tag_base = 1u << 30;
    tag_mask = (1u << 30) - 1;
  }
  c10::intrusive_ptr<Backend> gloo;
  c10::intrusive_ptr<Backend> nccl;  // created on the first CUDA tensor (same point on all ranks)
  // Multi-node runs (nccl_backend.h, spans_nodes): messages between ranks of different nodes go on
  // a communicator of their own, whose NCCL stream runs beside `nccl`'s, so that a double ring's
  // inter-node hop overlaps the intra-node hops posted after it. Null otherwise (and for adopted
  // torch.distributed groups): every CUDA message goes on `nccl`.
  c10::intrusive_ptr<Backend> nccl_inter;
  int node_size = 1;  // ranks per node (LOCAL_WORLD_SIZE): pairs with different r / node_size
  // Per-peer message numbers: the Gloo tags. Taken and posted under post_mu, so that threads
  // posting at once (autograd's backward thread and the main thread) never share a tag, and a
  // batch's messages keep consecutive tags (NCCL: one coalesced group call per batch).
  std::mutex post_mu;
  std::vector<uint32_t> send_seq, recv_seq;
  std::atomic<int64_t> agreement_seq{0};
  // Heartbeat: a second store client bumps lvx/hb/<rank> so that a failure can name the rank
  // that stopped.
  std::thread heartbeat;
  std::mutex mu;
  std::condition_variable cv;
  bool stopping = false;
  // Fault state, guarded by fault_mu. `pending` holds every posted engine request not yet waited;
  // after the first failure they move to `aborted`, which keeps them (and the tensors they
  // reference) alive until the group is destroyed, since the engine may still touch them.
  mutable std::mutex fault_mu;
  std::string failure;  // the first failure; empty while the group is healthy
  std::map<c10d::Work*, c10::intrusive_ptr<c10d::Work>> pending;
  std::vector<c10::intrusive_ptr<c10d::Work>> aborted;
  std::vector<int> found_dead;  // the ranks this rank's own diagnosis found unresponsive

  // CUDA tensors without NCCL (lvx built without CUDA, or ranks sharing a GPU, which NCCL refuses:
  // nccl_backend.h) go through Gloo, staged in host memory: sends are copied to the host when
  // posted, receives land in a host buffer copied to the device when waited for.
  bool stage_cuda() const { return !nccl && cuda_via_host; }
  bool cuda_via_host = false;

  // Posts `batch` (rank `rank`'s messages) on `engine` under post_mu, each request tracked in
  // `pending` and `work`; coalesce: one NCCL group call, waited on by the stream. `staged`: the
  // device tensor of each host receive buffer (stage_cuda). process_group_p2p.cpp.
  void post(Backend& engine, std::vector<P2POp>& batch, bool coalesce, int rank, Work::Impl& work,
            const std::map<const at::TensorImpl*, at::Tensor>& staged);

  Backend& backend_for(const at::Tensor& t) {
    if (t.is_cuda()) {
      LVX_CHECK(nccl, "CUDA tensor given but lvx was built without CUDA/NCCL");
      return *nccl;
    }
    return *gloo;
  }
};

// What a request carries, counted once it completes: bytes to or from one peer.
struct CountedMessage {
  P2POp::Kind kind;
  int peer;
  int64_t bytes;
};

struct Work::Impl {
  std::shared_ptr<ProcessGroup::Handle> group;
  std::string what;
  std::chrono::milliseconds timeout{0};
  // One engine request and the messages it carries (counted once it completes).
  using Msg = CountedMessage;
  struct Posted {
    c10::intrusive_ptr<c10d::Work> work;
    std::vector<Msg> msgs;
    // NCCL: waited on by the caller's CUDA stream, not the host (nccl_stream_wait); the engine's
    // watchdog bounds it by the timeout.
    bool stream_ordered = false;
    // Host staging of a CUDA receive through Gloo: `staged` (host) is copied into `device` once
    // the message is in.
    at::Tensor staged, device;
    // An engine collective: msgs are its algorithm's volume, counted as formula-counted too.
    bool formula = false;
  };
  std::vector<Posted> posted;
  bool done = false;
};

}  // namespace lvx::dist
