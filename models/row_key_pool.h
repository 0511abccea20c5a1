// The generated keys and values of the rows that step together (lvx serve's continuous batching,
// Model::extend_rows): one tensor per layer for all rows, each row a slot of it, instead of one
// tensor piece per row and step. A batched step then writes every row's new K/V with one
// index_copy_ per layer and reads the rows' slots in place with one kernels::slot_attention call,
// with no operation per row: at 16 rows of a small model, the per-row pieces (a narrow per row
// and layer, then a concatenation of every row's pieces per layer) were a tenth of a step.
//
// Layout per layer: k, v [S, Hkv, C, D] (S slots, C positions), head-major so that a slot's keys
// are a [Hkv, L, D] block the batched call reads as it is. A slot may start with a front (its
// row's cached prompt keys, set_fronts), its own keys after it. Positions past a slot's length
// hold zeros (acquire clears a reused slot, so nothing of an earlier row, not even a non-finite
// value, can reach the next one's product where a device reads the slots padded). The capacity
// doubles when a row outgrows it, as do the slots; memory is S·C per layer, the padded layout
// the batched product builds anyway, kept. The pool also keeps the batch's stacked prompt keys
// (stacked_keys: one copy of the prompt keys of the videos the rows read, per layer). A row's slot
// (RowSlot) is released when its cache goes; the pool goes with its last slot. Thread-safe: a row's
// cache may be dropped on another thread than the one stepping.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace lvx::models {

class RowKeyPool;

// A row's place in a RowKeyPool (DecodeCache::pooled): none, or a slot it alone holds. A copy
// takes a new slot in the same pool holding a copy of the keys; a move hands the slot over.
class RowSlot {
 public:
  RowSlot() = default;
  RowSlot(std::shared_ptr<RowKeyPool> pool, int64_t index);
  RowSlot(const RowSlot& other);
  RowSlot& operator=(const RowSlot& other);
  RowSlot(RowSlot&& other) noexcept;
  RowSlot& operator=(RowSlot&& other) noexcept;
  ~RowSlot();

  explicit operator bool() const { return pool_ != nullptr; }
  RowKeyPool* pool() const { return pool_.get(); }
  const std::shared_ptr<RowKeyPool>& shared_pool() const { return pool_; }
  int64_t index() const { return index_; }
  void reset();  // releases the slot

 private:
  std::shared_ptr<RowKeyPool> pool_;
  int64_t index_ = -1;
};

class RowKeyPool {
 public:
  explicit RowKeyPool(size_t layers);

  int64_t acquire();              // a free slot, empty and zeroed in every layer
  void release(int64_t slot);     // its keys are left as they are (cleared when reused)
  int64_t copy_of(int64_t slot);  // a new slot holding `slot`'s keys
  int64_t used(size_t layer, int64_t slot) const;
  // The room allocated in `layer`: {slots, positions} (0, 0 before its first keys).
  std::pair<int64_t, int64_t> capacity(size_t layer) const;

  // Appends T tokens' k, v [T, Hkv, D] to one slot of `layer`.
  void append(size_t layer, int64_t slot, const at::Tensor& k, const at::Tensor& v);
  // Appends the N tokens of several slots at once: slots[i] gets counts[i] tokens, the rows'
  // tokens side by side in k, v [N, Hkv, D]. One index_copy_ each.
  void append_rows(size_t layer, const std::vector<int64_t>& slots,
                   const std::vector<int64_t>& counts, const at::Tensor& k, const at::Tensor& v);
  // A copy of one slot's keys as [1, used, Hkv, D] each (a cache leaving the pool).
  std::pair<at::Tensor, at::Tensor> slot_keys(size_t layer, int64_t slot) const;
  // Every slot's keys of `layer` in place, k, v [S, Hkv, C, D] (kernels::slot_attention reads
  // the rows' slots from them; positions past a slot's own: stale or zeros). With fronts
  // (set_fronts), a slot's positions start with its front.
  std::pair<at::Tensor, at::Tensor> layer_keys(size_t layer) const;
  // A slot's front in `layer`: keys kept before its own (a row's cached prompt keys, so that one
  // call reads them with its own: rows_new_keys' prompt front), its own keys after them.
  // fronts[i] (k, v [1, P, Hkv, D]) becomes slots[i]'s front, written only where the slot does
  // not hold those very tensors already (held: their address cannot be reused); with no fronts,
  // every slot's front is dropped. Either moves the slot's own keys behind the front.
  void set_fronts(size_t layer, const std::vector<int64_t>& slots,
                  const std::vector<std::pair<at::Tensor, at::Tensor>>& fronts);
  int64_t front(size_t layer, int64_t slot) const;  // its length (0: none)

  // The cached prompt keys several groups of the batch read (each group's video: k, v [1, P,
  // Hkv, D], all of one shape) stacked as [G, P, Hkv, D] each, so that one attention call serves
  // every group (rows_cached_partial). Kept with the tensors it was made of (held, so none can be
  // freed and its address reused) while later steps ask for the same set in any order; rebuilt
  // when the set changes. places[i]: sources[i]'s place in the stack.
  std::pair<at::Tensor, at::Tensor> stacked_keys(
      size_t layer, const std::vector<std::pair<at::Tensor, at::Tensor>>& sources,
      std::vector<int64_t>& places);
  // How many groups' keys `layer`'s stack holds (0: none stacked yet).
  size_t stacked_sources(size_t layer) const;

 private:
  // Room for `length` positions and every slot in `layer` (allocated like `like` [., Hkv, D]).
  void reserve(size_t layer, int64_t length, const at::Tensor& k_like, const at::Tensor& v_like);
  void append_locked(size_t layer, int64_t slot, const at::Tensor& k, const at::Tensor& v);
  // Moves a slot's own keys to start at `front` (its front becomes that long); the room for them
  // reserved by the caller.
  void move_own(size_t layer, int64_t slot, int64_t front);

  mutable std::mutex mu_;
  std::vector<at::Tensor> k_, v_;           // per layer: [S, Hkv, C, D] (undefined: none yet)
  std::vector<std::vector<int64_t>> used_;  // per layer, per slot: own positions written
  // Per layer, per slot: the front (set_fronts) before the own positions, and its tensors.
  std::vector<std::vector<int64_t>> front_;
  std::vector<std::vector<std::pair<at::Tensor, at::Tensor>>> front_of_;
  std::vector<bool> taken_;  // per slot
  struct Stacked {
    std::vector<std::pair<at::Tensor, at::Tensor>> sources;
    at::Tensor k, v;
  };
  std::vector<Stacked> stacked_;  // per layer (stacked_keys)
};

}  // namespace lvx::models
