// Layer-by-layer sharding for `lvx finetune`: ZeRO stages 2 and 3 (parallel.shard: gradients,
// parameters). Stage 3: the trainable parameters exist whole only while the layer that uses them
// runs. Stage 2 uses the same machinery without the parameters' part (they stay whole and
// replicated): each layer's gradients exist whole only from the moment the backward reaches the
// layer until they are complete and reduce-scattered. After "ZeRO: Memory Optimizations Toward
// Training Trillion Parameter Models" (Rajbhandari et al., 2020, §5.3, P_os+g+p) and PyTorch
// FSDP's FULL_SHARD (Zhao et al., 2023: one unit per layer, storage freed after its forward and
// refilled before its backward, the root unit kept for the whole step).
//
// Units. Decoder layer l (Model::decoder_layer_of) is one unit; every other trainable parameter
// (embeddings, final norm, head, projector or resampler) forms the root unit. Each unit has one
// buffer in the parameters' dtype on the device; the model's parameters are tensors over it
// (leaves of their own, not views, so writing the buffer never bumps their version). Between
// uses the buffer's storage is freed (0 bytes); the parameters keep their shapes.
//
// Where the values live. Only in ShardedAdamW's fp32 masters (src/runtime/sharded_state.h: rank r
// owns the flat elements shard_range(Ψ, n, r) of the trainable parameters in name order). A
// gather all-gathers, per contiguous range of the unit in that flat order, every rank's overlap
// with it (uneven sizes: a layer usually lies in one or two ranks' shards) cast to the dtype —
// exactly what stages 1 and 2 all-gather after each update, so the parameters are the same.
//
// One sample (begin_sample, the model's forward, the backward, end_sample):
//   forward   the root unit is gathered first; enter_layer(i) frees layer i−1 and gathers
//             layer i; the last layer stays gathered (its backward comes first);
//   backward  a hook on the gradient of each layer's output gathers the layer again (in the
//             fixed order L−1, …, 0: a request for layer j first gathers every later one still
//             missing) and zeroes its gradient buffer, which the parameters' .grad view; when
//             every parameter of a unit has accumulated (post-accumulate-grad hooks), the unit is
//             freed and its gradients reduce-scattered onto their owners' fp32 shard;
//   end       units that never completed (a layer the sample skipped) are reduced as they are;
//             then everything is freed.
// Reductions run in the fixed order L−1, …, 0, root on a thread and a process group of their own,
// so the backward never waits for them: data-parallel groups whose samples take different paths
// (a layer skipped for a sample without images) reach them in the same order, and no rank's
// gather can wait on another's reduction. Gathers run on a second thread over a second group of
// their own, in the fixed order root, 0, …, L−1, L−2, …, 0 per sample on every rank, each posted
// one layer ahead (layer i+1's while layer i runs forward, layer j−1's while layer j runs
// backward), so its communication overlaps the layer's compute.
//
// Memory per rank (elements: Ψ trainable, Ψ_u a unit's, s_p bytes per parameter element):
// 12Ψ/n + 4Ψ/n of optimizer state and gradient shard; whole: the root unit and at most two
// layers (the running one and the next gathered, or the last layer kept) with their gradients
// while their backward runs (s_p + 4 bytes per element during the reduction); with the prefetch,
// a third layer for as long as the next layer's gather overlaps.
//
// Stage 2 (shard_parameters false) skips every gather and free: the units only give the
// gradients their per-layer buffers and reductions (e·Ψ_root + e·(two layers) instead of e·Ψt),
// and after the update refresh_parameters gathers the new values into the whole parameters one
// run at a time.
//
// On a GPU the threads' work is ordered against compute by the process group's waits (NCCL work
// makes the current stream wait, ProcessGroup::Work); not run on a GPU yet.
//
// Frozen parameters (stage 3). A decoder layer's parameters that do not train (a LoRA run's whole
// base model, a freeze policy's frozen layers) are sharded too, as FSDP shards a frozen base: the
// unit keeps 1/n of their flat vector (in their dtype, shard_range over the unit's frozen
// elements), all-gathers it into a second buffer with the trainable part, and frees it only once
// the backward has passed the whole layer (the hook on the layer's input gradient), since a
// frozen weight is still read for the input's gradient after the unit's trainable gradients have
// all accumulated (LoRA's A and B come before the base product in the backward). Frozen
// parameters outside the decoder layers (the vision tower, the embeddings of a LoRA run) stay
// replicated.
#pragma once

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "models/model.h"
#include "models/parallel.h"
#include "src/dist/process_group.h"
#include "src/runtime/sharded_state.h"

namespace lvx::runtime {

// One thread that runs the tasks posted to it in order (the engine's gathers, its reductions).
// A task's future rethrows its error. The destructor finishes what was posted.
class TaskThread {
 public:
  TaskThread();
  ~TaskThread();
  TaskThread(const TaskThread&) = delete;
  TaskThread& operator=(const TaskThread&) = delete;
  std::shared_future<void> post(std::function<void()> task);

 private:
  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::packaged_task<void()>> tasks_;
  bool stopping_ = false;
};

class LayerSharding final : public models::LayerHooks {
 public:
  // shard_parameters (stage 3): replaces each trainable parameter (`layout`'s names; meta or
  // whole) of `model` by a tensor of its shape over its unit's buffer on `device`, and frees the
  // buffers; `opt` holds the values (its masters, initialised). Otherwise (stage 2) the
  // parameters stay as they are (whole, on `device`). Collective over `world` (creates the
  // engine's groups).
  // Stage 3 also shards the decoder layers' frozen parameters (whole, or meta and then read
  // with `read_frozen`, which returns one whole tensor by name).
  using FrozenReader = std::function<at::Tensor(const std::string&)>;
  LayerSharding(const std::shared_ptr<dist::ProcessGroup>& world, models::Model& model,
                const FlatLayout& layout, const ShardedAdamW& opt, const at::Device& device,
                bool shard_parameters, const FrozenReader& read_frozen = {});
  ~LayerSharding() override;
  LayerSharding(const LayerSharding&) = delete;
  LayerSharding& operator=(const LayerSharding&) = delete;

  // Before a sample's forward: gathers the root unit. `shard` (fp32, this rank's elements
  // [opt.begin(), opt.end())) receives every gradient reduced for this sample.
  void begin_sample(at::Tensor shard);
  void enter_layer(int64_t layer, const at::Tensor& hidden) override;
  void leave_layers(const at::Tensor& hidden) override;
  // After the backward: reduces what is left, waits for every reduction (rethrowing its error),
  // frees every unit. Collective.
  void end_sample();

  // Forwards without a backward (the held-out loss of an evaluation): the root unit is gathered
  // at begin, each forward's enter_layer gathers its layer and frees the one before as in
  // training, end frees everything. No gradient buffers. Collective: every rank must run the
  // same number of forwards in between (the gathers are the world's).
  void begin_forward_only();
  void end_forward_only();

  // Stage 2, after the optimizer's step: the updated masters into every rank's (whole)
  // parameters, one run of a unit at a time (not the whole flat vector at once). Collective.
  void refresh_parameters();

  // Stage 3: the sharded parameters whole (trainable and frozen), gathered unit by unit and
  // copied to the host on `root` (the other ranks get an empty map). Collective.
  std::map<std::string, at::Tensor> consolidated(int root);

  // Bytes this rank sent on the engine's groups (gathers and reductions) since construction.
  int64_t bytes_sent() const;

  // Called by the parameters' post-accumulate-grad hooks.
  void accumulated(size_t unit);

 private:
  struct Range {
    int64_t begin, end, local;  // flat elements [begin, end) at buffer offset `local`
  };
  struct Unit {
    std::vector<std::string> names;
    std::vector<int64_t> global;  // each name's first flat element
    std::vector<int64_t> local;   // each name's buffer offset
    std::vector<Range> ranges;
    int64_t numel = 0;
    at::Tensor buffer;  // storage freed while not gathered
    at::Tensor grad;    // during the unit's backward
    size_t pending = 0;
    bool gathered = false;             // requested (the gather may still run: `ready`)
    std::shared_future<void> ready;    // the gather on the gathering thread
    bool prepared = false, completed = false;
    // Frozen parameters (stage 3): names, buffer offsets, this rank's piece of their flat vector.
    std::vector<std::string> frozen_names;
    std::vector<int64_t> frozen_local;
    int64_t frozen_numel = 0;
    at::Tensor frozen_buffer;  // storage freed while not gathered
    at::Tensor frozen_shard;   // elements dist::shard_range(frozen_numel, n, rank)
  };

  void request(size_t u);     // posts the unit's gather (in the fixed order, on every rank)
  void wait_ready(size_t u);  // until its gather is done (rethrows its error)
  void gather(size_t u);      // request + wait_ready
  at::Tensor gather_run(const Range& r) const;  // every rank's piece of a run, in the dtype
  void release(size_t u);
  void free_trainable(size_t u);  // the unit's trainable buffer only (its frozen one stays)
  void shard_frozen(Unit& u, const FrozenReader& read);  // construction: the piece, the buffer
  at::Tensor gather_frozen(const Unit& u) const;         // every rank's piece, whole
  void reach_backward(int64_t layer);  // the backward reached layer `layer`'s output
  // Gathers the unit and zeroes its gradient buffer, which its parameters' .grad view.
  void prepare(size_t u);
  void complete(size_t u);
  void post_ready();

  bool shard_parameters_;
  at::Device device_;
  std::shared_ptr<dist::ProcessGroup> gather_pg_, reduce_pg_;
  at::TensorOptions grad_options_;  // the parameters' dtype, on the device
  models::Model& model_;
  const ShardedAdamW& opt_;
  int64_t psi_;
  int64_t layers_;
  std::vector<Unit> units_;                // [0, layers_): decoder layers; layers_: the root
  std::vector<size_t> order_;              // reductions: layers_ − 1, …, 0, root
  size_t next_post_ = 0;                   // index into order_
  int64_t next_backward_ = -1;             // the next layer the backward gathers
  at::Tensor shard_;                       // this sample's gradient shard (fp32)
  std::vector<std::shared_future<void>> reductions_;  // this sample's

  // Declared last: destroyed first, finishing their tasks while the rest still exists.
  TaskThread reducer_;   // reductions over reduce_pg_
  TaskThread gatherer_;  // gathers over gather_pg_ (stage 3; prefetched one layer ahead)
};

}  // namespace lvx::runtime
