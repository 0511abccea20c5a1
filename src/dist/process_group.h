// The one communication interface of lvx. Every distributed algorithm (attention strategies,
// video sharding, benchmarks) talks through ProcessGroup; it runs on real engines only:
//   - CPU tensors: Gloo through libtorch's c10d (ranks are separate processes, TCP between them);
//   - CUDA tensors: NCCL through c10d (its own communication stream, ordered against the caller's
//     compute stream with events), when lvx is built with CUDA. Waiting for NCCL messages never
//     blocks the host: the caller's current CUDA stream waits on them (nccl_backend.h), so a ring
//     hop overlaps the next block's compute; NCCL's watchdog bounds them by Options::timeout. In a
//     run over several nodes (LOCAL_WORLD_SIZE < WORLD_SIZE) inter-node messages go on a second
//     communicator (its own stream), so inter- and intra-node hops of a double ring overlap.
//     Without NCCL (ranks sharing one GPU, or LVX_DIST_CUDA_ENGINE=gloo) CUDA tensors go through
//     Gloo staged in host memory (copied to the host when posted, to the device when waited for).
// Collectives run on the engines' own algorithms (collectives.cpp): c10d's allreduce,
// allgather_into_tensor and broadcast, on Gloo for CPU tensors and NCCL for CUDA ones (one kernel
// with NCCL's ring/tree/NVLS algorithms), and NCCL's reduce-scatter; not host-driven steps of
// point-to-point messages. Gloo's reduce_scatter is an all-reduce narrowed to each rank's chunk
// (twice the ring's bytes, measured), so on Gloo reduce_scatter stays lvx's ring of messages.
// What the engine moves inside a collective is not visible message by message, so each rank
// counts its share by the formula of the algorithm, attributed to the ring's neighbours or the
// tree's peers, and also adds it to ByteCounters::formula_sent / formula_received:
//   all_gather of S bytes per rank  : ring, every chunk but next's sent, every one but its own
//                                     received: (n-1)·S each way; uneven pieces (one or two ranks
//                                     own a ZeRO run): a broadcast from each owner, as below
//   all_reduce of S bytes           : ring reduce-scatter + all-gather, 2·(n-1)/n·S each way
//   reduce_scatter of S bytes       : ring, every chunk but its own sent: (n-1)/n·S (NCCL's;
//                                     on Gloo lvx's own ring, the same bytes, counted per message)
//   broadcast of S bytes            : Gloo's binomial tree (the root sends S to ⌈log2 n⌉ peers,
//                                     each other rank receives S once and forwards it down its
//                                     subtree); NCCL's ring chain (every rank but the one before
//                                     the root sends S to next)
// NCCL runs the ring for these on one node; its tree, NVLS or CollNet choices move the same
// bytes per rank to within the ring's (n-1)/n factor. Measured on this wheel's Gloo (4 ranks,
// 67 MB, bytes on the loopback): all_reduce 403 MB, allgather 201 MB, broadcast 202 MB, as the
// formulas give. The point-to-point messages of the
// attention strategies, and all_to_all (a pairwise exchange), are counted message by message:
//   ring exchange of S bytes        : sends S to next, receives S from previous
//   all_to_all with splits s_j      : Σ_{j≠r} s_j sent to the owners (pairwise exchange)
// Byte counters count the payload of messages that completed: a send once the engine reports it
// done, a receive once its data is in the tensor (both seen by Work::wait; for NCCL, once the
// caller's stream is ordered after them, a failure later failing the whole group). Messages of a
// request that failed or was aborted are not counted; neither are headers or transport overhead.
// Threads and communicators (deadlock safety on NCCL, whose collectives on one communicator
// must be issued in the same order on every rank): a group's engines (Gloo, NCCL and, across
// nodes, the inter-node NCCL communicator) are created eagerly when the group is constructed,
// and groups are constructed in the same order on every rank (the world, then a job's subgroups:
// data × sequence parallel groups, stage 3's reduce group and gather group;
// src/runtime/layer_sharding.h). Each thread that communicates owns a group of its own and
// issues its collectives in one fixed order (stage 3: reductions L−1, …, 0, root on the reduce
// thread; gathers root, 0, …, L−1, L−2, …, 0 on the gather thread; everything else on the main
// thread); autograd's backward thread posts only point-to-point messages, serialised with the
// main thread's by the group's post lock (Engine::post_mu). No two threads ever share a group's
// collectives, so no order between them needs to agree across ranks.
// Faults: every wait is bounded by Options::timeout; a peer that dies or stops answering turns
// into an lvx::Error on every other rank naming the operation and the failed rank (found from
// heartbeats kept in the rendezvous store), so no rank waits forever. The first failure (timeout
// or engine error) fails the whole group at once: every other pending request is aborted, so
// waiting for it or destroying it unwaited returns at once instead of waiting another timeout,
// and every later operation throws at once, naming the first failure. A rank thus reports a
// fault within one timeout (plus the diagnosis, 2.5 heartbeats) however many requests it had in
// flight.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <functional>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "src/dist/rendezvous.h"

namespace c10d {
class Store;
class Backend;
class Work;
}

namespace lvx::dist {

// Payload bytes of this rank's completed messages, per peer, since construction or the last
// reset(). A message is counted when the wait() of its Work sees it complete (or the destructor
// of an unwaited Work does), so a request still in flight, or one that failed, adds nothing.
// The group updates its counters under a lock (messages may complete on several threads, e.g.
// autograd's backward thread while the main thread posts): read them from another thread with
// ProcessGroup::counters_snapshot() and reset them with ProcessGroup::reset_counters().
struct ByteCounters {
  std::vector<int64_t> sent;      // [world_size], bytes this rank sent to each peer
  std::vector<int64_t> received;  // [world_size], bytes this rank received from each peer
  // Seconds this rank spent blocked waiting for messages (Work::wait and the collectives built
  // on it): communication that compute did not hide.
  double wait_seconds = 0;
  // Of the bytes above, those of engine collectives: counted by their algorithm's formula, not
  // message by message (see the volumes at the top of this file).
  int64_t formula_sent = 0, formula_received = 0;
  int64_t total_sent() const;
  int64_t total_received() const;
  // Bytes sent to ranks on other nodes than `rank`'s (consecutive ranks share a node of
  // node_size ranks, as launchers number them; LOCAL_WORLD_SIZE): the traffic on the slow link.
  int64_t sent_inter_node(int rank, int node_size) const;
  void reset();
};

// How ProcessGroup's collectives run. The engines' own algorithms (collectives.cpp) or lvx's rings
// of point-to-point messages (collectives_p2p.cpp: the algorithms lvx ran before, also what
// bench_comm and bench_finetune time the engines against):
//   kAuto    (default) NCCL's own collectives for CUDA tensors; on Gloo, Gloo's allreduce (from 3
//            ranks) and broadcast, and lvx's rings for reduce_scatter, all_gather and the
//            all_reduce of 2 ranks, because Gloo's own are slower there: its reduce_scatter is an
//            all-reduce narrowed to each rank's chunk (twice the ring's bytes on the wire), its
//            allgather took 1.2-1.9x the ring's time at 2 and 4 ranks, its allreduce of 2 ranks
//            up to 1.26x (bench_comm, docs/collectives.md); from 3 ranks its allreduce is as
//            fast or faster
//   kEngine  the engine's own collective for every op, Gloo's reduce_scatter and allgather too
//   kP2P     lvx's rings for every op
enum class CollectiveImpl { kAuto, kEngine, kP2P };

struct Options {
  // Upper bound on any single wait; a dead or silent peer fails the operation within this.
  std::chrono::milliseconds timeout{60000};
  // How often each rank bumps its heartbeat in the store (used only to name a failed rank).
  std::chrono::milliseconds heartbeat{1000};
  CollectiveImpl collectives = CollectiveImpl::kAuto;
};

// Reads LVX_DIST_TIMEOUT_S (seconds) into Options::timeout and LVX_DIST_COLLECTIVES
// (auto | engine | p2p) into Options::collectives when set.
Options options_from_env();

enum class ReduceOp { kSum, kMax, kMin };

// One message of a batch: send `tensor` to `peer`, or receive into `tensor` from `peer`.
// Tensors must be contiguous; a receive's size is known in advance (no size negotiation).
struct P2POp {
  enum Kind { kSend, kRecv };
  Kind kind;
  at::Tensor tensor;
  int peer;
  static P2POp send(const at::Tensor& t, int peer) { return {kSend, t, peer}; }
  static P2POp recv(const at::Tensor& t, int peer) { return {kRecv, t, peer}; }
};

class ProcessGroup;
struct CountedMessage;  // process_group_state.h

// Handle for messages in flight. wait() blocks until all are done (or throws lvx::Error naming
// the operation and the failed rank). Destroying an unwaited Work waits for it, except after its
// group failed: then its messages were aborted and the destructor returns at once (the engine
// keeps their tensors alive until the group is destroyed).
// A Work refers to its group through a shared handle, never a bare pointer: waiting for a Work
// whose group was destroyed throws lvx::Error (its messages are abandoned, never counted), and
// destroying such a Work returns at once. A group being destroyed while another thread waits
// for one of its Works lets that wait finish first (bounded by the timeout).
class Work {
 public:
  Work();
  Work(Work&&) noexcept;
  Work& operator=(Work&&) noexcept;
  ~Work();
  void wait();
  bool valid() const { return impl_ != nullptr; }

 private:
  friend class ProcessGroup;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class ProcessGroup {
 public:
  // Joins the run described by `info` (rank 0 hosts the TCP rendezvous store).
  explicit ProcessGroup(const RendezvousInfo& info, Options options = {})
      : ProcessGroup(info, options, /*connect=*/true) {}
  // Runs on a torch.distributed process group (found by its group_name in c10d's registry, as
  // torch's functional collectives find theirs): its Gloo backend for CPU tensors, its NCCL
  // backend for CUDA tensors, its store for heartbeats and agreement checks. Ranks are the
  // group's ranks. lvx's Gloo messages use tags from 2^30 up, clear of the user's own
  // send/recv tags. The counters count lvx's messages only.
  static std::shared_ptr<ProcessGroup> adopt(const std::string& torch_group_name,
                                             Options options = options_from_env());
  // Reads the environment (torchrun, then OpenMPI variables) and joins.
  static std::shared_ptr<ProcessGroup> from_env(Options options = options_from_env());
  // A group of `parent`'s ranks [first, first + size) (this rank among them), e.g. one
  // sequence-parallel group of a data × sequence parallel run. Collective over those ranks only
  // (each group's ranks construct theirs at the same point). Its engines are its own (Gloo, and
  // NCCL for CUDA tensors) and its rendezvous keys live under a prefix of their own in the
  // parent's store; ranks are numbered 0..size−1 (parent rank − first); counters count its own
  // messages. A group of one rank needs no engine. `name` tells apart groups of the same ranks
  // (ZeRO stage 3 gathers and reduces on groups of their own beside the world's).
  static std::shared_ptr<ProcessGroup> subgroup(const std::shared_ptr<ProcessGroup>& parent,
                                                int first, int size, const std::string& name = "");
  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int next() const { return (rank_ + 1) % world_size_; }
  int prev() const { return (rank_ + world_size_ - 1) % world_size_; }
  const RendezvousInfo& info() const { return info_; }

  // ---- point to point --------------------------------------------------------------------
  // Posts every op of the batch at once and returns; wait() on the result. Sends and receives
  // of one batch can never deadlock against each other, whatever their order. Zero-size
  // tensors are skipped on both sides (their sizes are known to both). Messages between a pair
  // of ranks are matched in the order they were posted.
  Work batch_isend_irecv(std::vector<P2POp> ops, const char* what = "batch_isend_irecv");
  // Ring step: send `send` to next(), receive into `recv` from prev(); async.
  Work ring_exchange(const at::Tensor& send, const at::Tensor& recv,
                     const char* what = "ring_exchange");

  // ---- collectives (blocking, every rank must call them in the same order) ---------------
  // Concatenates every rank's `input` along dim 0 (shapes may differ in dim 0 only; `sizes`
  // gives each rank's dim-0 size, or empty when all equal the local one).
  at::Tensor all_gather(const at::Tensor& input, const std::vector<int64_t>& sizes = {});
  // Reduces `tensor` in place across ranks.
  void all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // Ring reduce-scatter of a flat tensor of n elements: returns rank r's chunk
  // [n·r/w, n·(r+1)/w) (shard_range) reduced over every rank, as a view of `tensor`, whose other
  // chunks are left partly reduced (scratch). (n−1)/n·S bytes sent and received per rank for S
  // bytes: half an all_reduce. Contiguous 1-D input only.
  at::Tensor reduce_scatter(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
  // The same with rank j's chunk `splits[j]` elements long (in rank order, summing to n; zeros
  // allowed): each rank sends every chunk but its own once.
  at::Tensor reduce_scatter(at::Tensor& tensor, const std::vector<int64_t>& splits,
                            ReduceOp op = ReduceOp::kSum);
  // Splits `input` along dim 0 into send_splits[j] rows for rank j, and returns the rows
  // received from every rank concatenated in rank order (recv_splits[j] rows from rank j).
  at::Tensor all_to_all(const at::Tensor& input, const std::vector<int64_t>& send_splits,
                        const std::vector<int64_t>& recv_splits);
  // Copies root's `tensor` into every rank's `tensor` (same shape and dtype everywhere).
  void broadcast(at::Tensor& tensor, int root);
  void barrier();

  // Fails on every rank, naming the ranks that differ, unless all ranks pass the same `value`
  // for `what` (for example "world=4 strategy=lv_xattn q=[1,64,8,64]"). Call it before the first
  // collective of a run so that a mismatched launch fails clearly instead of hanging.
  void check_agreement(const std::string& what, const std::string& value);

  // The counters themselves, for code that reads or resets them while no other thread runs
  // messages of this group (the usual single-threaded loop).
  ByteCounters& counters() { return counters_; }
  const ByteCounters& counters() const { return counters_; }
  // A consistent copy, and a reset, safe while other threads' messages complete.
  ByteCounters counters_snapshot() const;
  void reset_counters();

  // Internal: turns an engine failure into an error naming the operation and the failed rank,
  // and fails the group (aborts every pending request; later operations throw at once).
  [[noreturn]] void fail(const std::string& what, const std::string& cause);
  // How this group moves CUDA tensors: "nccl" (lvx built with CUDA, one GPU per local rank),
  // "nccl+inter" (the same, with a second communicator for inter-node pairs), "gloo-host-staged"
  // (ranks sharing a GPU, LVX_DIST_CUDA_ENGINE=gloo, or no CUDA build), "none" (world size 1).
  std::string cuda_engine() const;
  // The first failure of this group, or empty while it is healthy.
  std::string failure() const;
  // Options::collectives, switched after construction (bench_comm times each). Every rank must
  // switch it at the same point.
  void set_collectives(CollectiveImpl impl) { options_.collectives = impl; }

 private:
  friend class Work;
  struct Engine;
  struct Handle;  // what Works hold: the group while it lives (see Work)
  ProcessGroup(const RendezvousInfo& info, Options options, bool connect);
  void start_heartbeat();
  // A store connection of its own (heartbeats, failure diagnosis).
  c10::intrusive_ptr<c10d::Store> store_client(std::chrono::milliseconds timeout);
  // Throws at once when the group has failed: `what` is not started.
  void check_not_failed(const std::string& what) const;
  // Waits for the messages of `w`, counting those that complete (Work::wait and ~Work).
  void wait_work(Work::Impl& w);
  // Aborts every pending request after a failure; returns at once.
  void abort_pending();
  // One engine collective on `t` (collectives.cpp): posted by `post` on t's engine (CUDA tensors
  // without NCCL on a host copy), waited for like a batch of messages, `msgs` counted as its
  // formula-counted volume.
  void run_collective(const std::string& what, at::Tensor& t, std::vector<CountedMessage> msgs,
                      const std::function<c10::intrusive_ptr<c10d::Work>(c10d::Backend&,
                                                                         at::Tensor&)>& post);
  // This rank's share of a broadcast of `bytes` from `root` on NCCL's ring chain or Gloo's
  // binomial tree.
  std::vector<CountedMessage> broadcast_volume(int64_t bytes, int root, bool nccl) const;
  // Whether reduce_scatter and all_gather of `t` run as lvx's rings: kP2P, or kAuto on Gloo
  // (CPU tensors, or CUDA tensors staged through the host).
  bool rings_for(const at::Tensor& t) const;
  // Whether NCCL carries `t` (a CUDA tensor and a NCCL engine), else Gloo.
  bool on_nccl(const at::Tensor& t) const;
  // Broadcast of `t` from `root` on the engine's collective, counted by its tree or chain;
  // `what` names the operation in errors (broadcast, or all_gather's per-owner pieces).
  void broadcast_engine(const char* what, at::Tensor& t, int root);
  // Whether all_reduce of `t` runs as lvx's ring: kP2P, or kAuto on Gloo at 2 ranks.
  bool ring_all_reduce(const at::Tensor& t) const;
  // reduce_scatter on the engine's collective, or on lvx's ring of messages; `off` holds the
  // chunks' offsets.
  at::Tensor reduce_scatter_engine(at::Tensor& tensor, const std::vector<int64_t>& splits,
                                   const std::vector<int64_t>& off, ReduceOp op);
  at::Tensor reduce_scatter_ring(at::Tensor& tensor, const std::vector<int64_t>& splits,
                                 const std::vector<int64_t>& off, ReduceOp op);
  // The other collectives as rings of messages (collectives_p2p.cpp). all_gather_ring fills
  // `out` (this rank's piece already in place; piece j at rows [offset[j], offset[j+1])).
  void all_reduce_ring(at::Tensor& tensor, ReduceOp op);
  void all_gather_ring(at::Tensor& out, const std::vector<int64_t>& offset);
  void broadcast_star(at::Tensor& tensor, int root);
  void linger_for_peers();  // store host only: see ~ProcessGroup
  RendezvousInfo info_;
  Options options_;
  int rank_ = 0;
  int world_size_ = 1;
  mutable std::mutex counters_mu_;  // guards counters_ (Work::wait on any thread updates them)
  ByteCounters counters_;
  std::shared_ptr<Handle> handle_;
  std::unique_ptr<Engine> engine_;
};

// The chunk [begin, end) of n elements that rank r of w owns in reduce_scatter and in sharded
// training state: [n·r/w, n·(r+1)/w), so chunk sizes differ by at most one element.
inline std::pair<int64_t, int64_t> shard_range(int64_t n, int world, int rank) {
  return {n * rank / world, n * (rank + 1) / world};
}

// Every rank's error text for one unit of work ("" where it went fine), so that all ranks act
// together (skip a question, stop a run) instead of the healthy ones waiting in the next
// collective until the timeout: a damaged frame may sit in one rank's share only. One small
// all_reduce of flags; the texts (cut at 2047 bytes) are gathered only when some rank failed.
// No collective at world size 1.
std::vector<std::string> gather_errors(ProcessGroup& pg, const std::string& error);

}  // namespace lvx::dist
