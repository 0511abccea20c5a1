// Distributed exact attention: one interface, one file per strategy (nccl-tests' testColl
// pattern). Every strategy computes exactly softmax(scale·QKᵀ + mask)·V over the global
// sequences, forward and backward, and must agree with single-device attention.
//
//   lv_xattn   K/V stationary; Q, partial O (fp32) and lse rotate (LV-XAttn, Chang &
//              Venkataraman ICML'25, §3.1 and eq. (1)); backward rotates Q, dO, lse, delta and
//              the fp32 dQ accumulator while dK/dV accumulate locally (BurstAttention Alg. 2).
//   ring       Q stationary; K/V rotate (BurstAttention Alg. 1 / Ring Attention); backward
//              rotates K, V and the fp32 dK/dV accumulators, dQ local (NOTES.md §7.7).
//   striped    ring over the striped token layout (Brandon et al. §3), balancing causal work.
//   ulysses    all-to-all from sequence to head sharding and back (DeepSpeed-Ulysses).
//   all_gather gather K/V, attend locally; backward reduce-scatters dK/dV (Llama-3 CP).
//
// Bytes sent per rank (n ranks, |X| = this rank's shard of X in its dtype, partial results in
// fp32 as |X|₃₂; every strategy posts the next transfer before computing, so per-round time is
// max(compute, communication) as in LV-XAttn eq. (1)):
//   lv_xattn  fwd  (n−1)·|Q| + n·(|O|₃₂ + |lse|)               [Q n−1 hops; O/lse n hops: home]
//             bwd  (n−1)·(|Q| + |dO| + |lse| + |δ|) + n·|dQ|₃₂
//   ring      fwd  (n−1)·(|K| + |V|)
//   striped   bwd  (n−1)·(|K| + |V|) + n·(|dK|₃₂ + |dV|₃₂)      [dK/dV return home]
//   ulysses   fwd  Σ_{j≠r} (|Q→j| + |K→j| + |V→j| + |O→j| + |lse→j|)  (each tensor's part for j)
//             bwd  Σ_{j≠r} (|dO→j| + |dQ→j| + |dK→j| + |dV→j|)   (grads in the input dtype)
//   all_gather fwd (n−1)·… ring all-gather of K and V: Σ_{j≠r+1} (|K_j| + |V_j|)
//             bwd  Σ_{j≠r} (|dK_j|₃₂ + |dV_j|₃₂)                (reduce-scatter, pairwise)
// With uneven shards every |X| is that block's own size (ring strategies send the block they
// hold at each hop); analytic_bytes() evaluates these exactly and tests compare them with the
// measured counters.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "src/attention/layout.h"
#include "src/dist/process_group.h"

namespace lvx::attention {

enum class StrategyKind { kLvXAttn, kRing, kStriped, kUlysses, kAllGather };

std::string strategy_name(StrategyKind k);
StrategyKind strategy_from_name(const std::string& name);  // error lists the valid names
std::vector<StrategyKind> all_strategies();

// Global description of one attention call; identical on every rank.
struct AttentionSpec {
  int64_t batch = 1, sq = 0, skv = 0, hq = 0, hkv = 0, head_dim = 0;
  kernels::MaskKind mask = kernels::MaskKind::kNone;
  kernels::MediaRule media_rule = kernels::MediaRule::kImmediate;
  double scale = 0;  // 0: 1/sqrt(head_dim)
  // kCausal with sq != skv aligns the last query with the last key: query i sits at key
  // position i + (skv − sq).
  int64_t causal_offset() const { return skv - sq; }
  std::string describe() const;  // for agreement checks and logs
};

// This rank's inputs. q/k/v are this rank's shards in the strategy's layouts (q_layout /
// kv_layout); the per-token mask metadata is small and given globally (every rank has the
// prompt), so no strategy has to ship it.
struct LocalInputs {
  at::Tensor q;  // [B, Sq_r, Hq, D]
  at::Tensor k;  // [B, Skv_r, Hkv, D]
  at::Tensor v;  // [B, Skv_r, Hkv, D]
  at::Tensor q_media;   // int32 [B, Sq] global (kMedia)
  at::Tensor kv_media;  // int32 [B, Skv] global (kMedia)
  at::Tensor kv_valid;  // optional bool [B, Skv] global padding mask
};

struct LocalOutput {
  at::Tensor o;    // [B, Sq_r, Hq, D], accumulation dtype (fp32 / fp64)
  at::Tensor lse;  // [B, Hq, Sq_r], accumulation dtype
};

struct LocalGrads {
  at::Tensor dq, dk, dv;  // this rank's shards, accumulation dtype
};

// What one call moved and how long it took on this rank.
struct CallStats {
  int64_t bytes_sent = 0, bytes_received = 0;
  double seconds = 0;
};

struct Volume {
  int64_t sent = 0, received = 0;
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual StrategyKind kind() const = 0;
  std::string name() const { return strategy_name(kind()); }
  virtual Layout q_layout(const AttentionSpec& s, int world) const;
  virtual Layout kv_layout(const AttentionSpec& s, int world) const;
  // Refuses, with a message saying why, specs this strategy cannot run (e.g. heads that do not
  // divide by the number of ranks for ulysses).
  virtual void check_supported(const AttentionSpec& s, int world) const {}

  virtual LocalOutput forward(dist::ProcessGroup& pg, const AttentionSpec& s,
                              const LocalInputs& in) = 0;
  // o and lse are this rank's forward results; dout has q's shard shape.
  virtual LocalGrads backward(dist::ProcessGroup& pg, const AttentionSpec& s,
                              const LocalInputs& in, const at::Tensor& o, const at::Tensor& lse,
                              const at::Tensor& dout) = 0;

  // The formulas of the header, evaluated for `rank` (element size from `dtype`).
  virtual Volume analytic_bytes(const AttentionSpec& s, int world, int rank, at::ScalarType dtype,
                                bool backward) const = 0;
};

std::unique_ptr<Strategy> make_strategy(StrategyKind k);

// ---- helpers shared by the strategies ----------------------------------------------------

// Kernel parameters for (queries at global positions q_pos) × (keys at k_pos): the mask metadata
// is sliced from the global tensors in `in`.
kernels::AttentionParams block_params(const AttentionSpec& s, const LocalInputs& in,
                                      const at::Tensor& q_pos, const at::Tensor& k_pos);

int64_t element_bytes(at::ScalarType t);

}  // namespace lvx::attention
