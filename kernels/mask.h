// Mask semantics shared by the CPU and CUDA kernels: per-entry visibility and per-tile
// classification (skip / full / partial) from per-tile min/max of the mask metadata.
// Internal to kernels/; the public mask description is AttentionMask in kernels/attention.h.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "kernels/attention.h"

#if defined(__CUDACC__)
#define LVX_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define LVX_HOST_DEVICE inline
#endif

namespace lvx::kernels {

// Raw view of an AttentionMask for the inner loops (all tensors contiguous, on the kernel's
// device). Entry (b, i, j) is visible iff the rule of `kind` holds and key j is not padding.
struct MaskView {
  int kind = 0;                       // MaskKind as int: 0 none, 1 causal, 2 media
  int rule = 0;                       // MediaRule as int: 0 immediate (==), 1 up-to (<=)
  const int64_t* q_pos = nullptr;     // [Sq]     (causal)
  const int64_t* k_pos = nullptr;     // [Skv]    (causal)
  const int32_t* q_media = nullptr;   // [B, Sq]  (media)
  const int32_t* kv_media = nullptr;  // [B, Skv] (media)
  const bool* kv_valid = nullptr;     // [B, Skv] or null (no padding)
  int64_t sq = 0;
  int64_t skv = 0;

  LVX_HOST_DEVICE bool visible(int64_t b, int64_t i, int64_t j) const {
    if (kv_valid != nullptr && !kv_valid[b * skv + j]) return false;
    if (kind == 1) return k_pos[j] <= q_pos[i];
    if (kind == 2) {
      const int32_t qm = q_media[b * sq + i];
      const int32_t km = kv_media[b * skv + j];
      if (qm < 0 || km < 0) return false;
      return rule == 0 ? km == qm : km <= qm;
    }
    return true;
  }
};

enum class TileVisibility : int { kNone = 0, kPartial = 1, kFull = 2 };

// Summary of one tile of tokens: min/max of the metadata over its tokens that can take part
// (causal positions; media indices >= 0), and whether some / all of its tokens take no part
// (media -1, or padding for keys).
struct TileSummary {
  int64_t lo;
  int64_t hi;
  bool has_none;
  bool all_none;
};

// The decision for one (query tile, key tile) pair; exact for kNone (no entry visible) and
// kFull (every entry visible), conservative otherwise (kPartial: build the mask).
LVX_HOST_DEVICE TileVisibility classify_tile(int kind, int rule, const TileSummary& qs,
                                             const TileSummary& ks) {
  if (qs.all_none || ks.all_none) return TileVisibility::kNone;
  const bool any_none = qs.has_none || ks.has_none;
  if (kind == 1) {
    if (qs.hi < ks.lo) return TileVisibility::kNone;
    return (!any_none && qs.lo >= ks.hi) ? TileVisibility::kFull : TileVisibility::kPartial;
  }
  if (kind == 2) {
    if (rule == 0) {
      if (qs.hi < ks.lo || ks.hi < qs.lo) return TileVisibility::kNone;
      const bool one = qs.lo == qs.hi && ks.lo == ks.hi && qs.lo == ks.lo;
      return (!any_none && one) ? TileVisibility::kFull : TileVisibility::kPartial;
    }
    if (ks.lo > qs.hi) return TileVisibility::kNone;
    return (!any_none && ks.hi <= qs.lo) ? TileVisibility::kFull : TileVisibility::kPartial;
  }
  return any_none ? TileVisibility::kPartial : TileVisibility::kFull;
}

// Mask metadata on one device, contiguous, plus per-tile summaries for the given tile sizes.
// Owns the tensors the raw view points into.
struct PreparedMask {
  MaskView view;
  int64_t q_tile = 0, k_tile = 0;  // tile sizes the summaries were built for
  int64_t n_q_tiles = 0, n_k_tiles = 0;
  at::Tensor q_lo, q_hi, q_has_none, q_all_none;  // [B, n_q_tiles] int64/bool
  at::Tensor k_lo, k_hi, k_has_none, k_all_none;  // [B, n_k_tiles]
  at::Tensor keep_[5];                            // contiguous metadata the view points into

  TileSummary q_summary(int64_t b, int64_t t) const;  // host only (CPU tensors)
  TileSummary k_summary(int64_t b, int64_t t) const;
};

// Validates `mask` against (batch, sq, skv) with messages naming the field, the expected and
// the actual shape/dtype, then moves the metadata to `device` and builds the tile summaries
// (with ATen ops, so it works for CPU and CUDA alike).
PreparedMask prepare_mask(const AttentionMask& mask, int64_t batch, int64_t sq, int64_t skv,
                          int64_t q_tile, int64_t k_tile, const at::Device& device);

}  // namespace lvx::kernels
