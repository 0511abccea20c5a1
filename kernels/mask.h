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

// ---- the one statement of the mask rules -------------------------------------------------
// Every mask compares one integer value per query with one per key (causal: global positions;
// media: media indices; none: 0 for all), after dropping tokens that take no part (media index
// −1; keys with kv_valid false). A key is visible to a query iff
//     k ≤ q,   and also k ≥ q when the rule is exact (media kImmediate: k == q).
// One exception (AttentionMask::unmatched_sees_all, media masks only): a query with media index
// −1 then sees every key that is not padding, kv_media −1 included.
// visible() below, mask_matrix() and visible_pairs() (kernels/mask.cpp) and classify_tile()
// all apply this one rule; `rule_visible` works on scalars and, elementwise, on at::Tensor.
LVX_HOST_DEVICE bool rule_is_exact(int kind, int rule) { return kind == 2 && rule == 0; }

template <typename T>
LVX_HOST_DEVICE auto rule_visible(bool exact, const T& q, const T& k) {
  return exact ? (k <= q) & (k >= q) : (k <= q);
}

// Raw view of an AttentionMask for the inner loops (all tensors contiguous, on the kernel's
// device). Entry (b, i, j) is visible iff both tokens take part and rule_visible holds.
struct MaskView {
  int kind = 0;                       // MaskKind as int: 0 none, 1 causal, 2 media
  int rule = 0;                       // MediaRule as int: 0 immediate (==), 1 up-to (<=)
  const int64_t* q_pos = nullptr;     // [Sq]     (causal)
  const int64_t* k_pos = nullptr;     // [Skv]    (causal)
  const int32_t* q_media = nullptr;   // [B, Sq]  (media)
  const int32_t* kv_media = nullptr;  // [B, Skv] (media)
  const bool* kv_valid = nullptr;     // [B, Skv] or null (no padding)
  bool see_all = false;               // media: q_media −1 sees every non-padding key
  int64_t sq = 0;
  int64_t skv = 0;

  LVX_HOST_DEVICE bool visible(int64_t b, int64_t i, int64_t j) const {
    if (kv_valid != nullptr && !kv_valid[b * skv + j]) return false;
    int64_t q = 0, k = 0;
    if (kind == 1) {
      q = q_pos[i];
      k = k_pos[j];
    } else if (kind == 2) {
      q = q_media[b * sq + i];
      k = kv_media[b * skv + j];
      if (q < 0) return see_all;
      if (k < 0) return false;
    }
    return rule_visible(rule_is_exact(kind, rule), q, k);
  }
};

enum class TileVisibility : int { kNone = 0, kPartial = 1, kFull = 2 };

// Summary of one tile of tokens: min/max of the rule values over its tokens that take part, and
// whether some / all of its tokens take no part (media −1, or padding for keys). Under
// unmatched_sees_all, queries' has_all / all_all say whether some / every query sees all keys
// (their has_none / all_none), and keys' has_pad / all_pad whether some / every key is padding
// (kv_valid false); both pairs are false otherwise.
struct TileSummary {
  int64_t lo;
  int64_t hi;
  bool has_none;
  bool all_none;
  bool has_all = false;  // queries
  bool all_all = false;
  bool has_pad = false;  // keys
  bool all_pad = false;
};

// The decision for one (query tile, key tile) pair, from rule_visible's interval form: query q
// sees keys in [q, q] (exact) or (−∞, q]; so some entry is visible iff k_lo ≤ q_hi (and, exact,
// k_hi ≥ q_lo), and every entry iff k_hi ≤ q_lo (and, exact, k_lo ≥ q_hi) with no token left
// out. A query that sees all keys sees some entry unless every key is padding, and the tile is
// full when every query sees all and no key is padding (a mix of both kinds of query: partial).
// Exact for kNone and kFull, conservative otherwise (kPartial: build the mask).
LVX_HOST_DEVICE TileVisibility classify_tile(int kind, int rule, const TileSummary& qs,
                                             const TileSummary& ks) {
  if (qs.has_all) {
    if (ks.all_pad) return TileVisibility::kNone;
    return qs.all_all && !ks.has_pad ? TileVisibility::kFull : TileVisibility::kPartial;
  }
  if (qs.all_none || ks.all_none) return TileVisibility::kNone;
  const bool exact = rule_is_exact(kind, rule);
  const bool some = ks.lo <= qs.hi && (!exact || ks.hi >= qs.lo);
  if (!some) return TileVisibility::kNone;
  const bool all = !qs.has_none && !ks.has_none && ks.hi <= qs.lo && (!exact || ks.lo >= qs.hi);
  return all ? TileVisibility::kFull : TileVisibility::kPartial;
}

// Mask metadata on one device, contiguous, plus per-tile summaries for the given tile sizes.
// Owns the tensors the raw view points into.
struct PreparedMask {
  MaskView view;
  int64_t q_tile = 0, k_tile = 0;  // tile sizes the summaries were built for
  int64_t n_q_tiles = 0, n_k_tiles = 0;
  at::Tensor q_lo, q_hi, q_has_none, q_all_none;  // [B, n_q_tiles] int64/bool
  at::Tensor k_lo, k_hi, k_has_none, k_all_none;  // [B, n_k_tiles]
  at::Tensor k_has_pad, k_all_pad;                // [B, n_k_tiles] (unmatched_sees_all only)
  at::Tensor keep_[5];                            // contiguous metadata the view points into

  TileSummary q_summary(int64_t b, int64_t t) const;  // host only (CPU tensors)
  TileSummary k_summary(int64_t b, int64_t t) const;
};

// The sizes of one CPU kernel call: q [B, Sq, Hq, D], k and v [B, Skv, Hkv, D] (group = Hq / Hkv
// query heads per K/V head), and its numbers of query and key tiles (from its prepared mask).
struct CallSizes {
  int64_t batch, sq, hq, d, skv, hkv, group, n_qt, n_kt;
};

inline CallSizes call_sizes(const at::Tensor& q, const at::Tensor& k, const PreparedMask& pm) {
  const int64_t batch = q.size(0), sq = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t skv = k.size(1), hkv = k.size(2);
  return CallSizes{batch, sq, hq, d, skv, hkv, hq / hkv, pm.n_q_tiles, pm.n_k_tiles};
}

// Validates `mask` against (batch, sq, skv) with messages naming the field, the expected and
// the actual shape/dtype, then moves the metadata to `device` and builds the tile summaries
// (with ATen ops, so it works for CPU and CUDA alike).
PreparedMask prepare_mask(const AttentionMask& mask, int64_t batch, int64_t sq, int64_t skv,
                          int64_t q_tile, int64_t k_tile, const at::Device& device);

}  // namespace lvx::kernels
