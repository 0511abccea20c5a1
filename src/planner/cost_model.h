// Analytic cost model of one attention layer under each distributed strategy: forward and
// backward time (compute, communication per round with overlap, per-message latency) and memory
// per rank. Pure functions of (layer workload, cluster, rank count, options); no I/O.
//
// Notation (per rank, n ranks, contiguous shards): sq = Sq/n, skv = Skv/n, e = element bytes,
// |Q| = sq·Hq·D·e, |K| = |V| = skv·Hkv·D·e (GQA: K/V travel with their own Hkv heads),
// |O32| = sq·Hq·D·4, |lse| = |delta| = sq·Hq·4, |dQ32| = sq·Hq·D·4, |dK32| = |dV32| = skv·Hkv·D·4.
// Partial outputs, softmax statistics and gradient accumulators travel in fp32.
//
// Compute (FlashAttention FLOP convention, Dao 2024; LV-XAttn Table 1): one block of sq queries
// against skv keys costs f = 4·sq·skv·Hq·D·ρ / F_fwd forward and 10·sq·skv·Hq·D·ρ / F_bwd
// backward, ρ = fraction of (query, key) pairs the mask leaves visible (tiles with no visible
// pair are skipped by kernels/attention.h). For causal self-attention the critical path differs
// per strategy (Striped Attention §3, NOTES.md §5.3): contiguous ring pays a full block every
// round but the diagonal one, striped pays about half a block every round.
//
// Communication: comm(B) = α + B/β for B > 0 bytes, with (α, β) of the slowest link used. A ring
// whose ranks span more than one node crosses the inter-node link on some hop, and every round
// waits for its slowest hop, so it runs at the inter-node (α, β). All-to-all: a rank's chunks to
// other nodes share the node's inter-node link with the node's other GPUs.
//
// Ring-structured strategies overlap each round's compute with the messages of that round
// (LV-XAttn eq. (1) for LV-XAttn, eq. (2) for Ring Attention):
//   T = Σ_{r=0}^{n-1} max(f_r, comm(a·[r < n-1] + b·[r ≥ 1])) + comm(b)
// where a is what travels ahead of round r+1 and b the partial result of round r that travels
// on (and finally home). Per rank this sends (n-1)·a + n·b bytes:
//   lv_xattn fwd: a = |Q|,                         b = |O32| + |lse|
//   lv_xattn bwd: a = |Q| + |dO| + |lse| + |delta|, b = |dQ32|
//   ring/striped fwd: a = |K| + |V|,               b = 0
//   ring/striped bwd: a = |K| + |V|,               b = |dK32| + |dV32|
// ulysses: all-to-all seq→head of q, k, v, attention of the whole sequence on Hq/n heads,
//   head→seq of o and lse, one all-to-all per tensor as src/attention does:
//   T_fwd = a2a(|Q|) + a2a(|K|) + a2a(|V|) + f_full/n + a2a(|O|) + a2a(|lse|); backward a2a(|dO|),
//   then a2a of dQ, dK, dV; a2a(X) moves (n-1)/n·X per rank. Needs Hq % n == 0 and Hkv % n == 0.
// all_gather: ring all-gathers of K then V, (n-1)·(comm(|K|) + comm(|V|)), then attention against
//   the full K/V; backward reduce-scatters dK then dV in fp32 (pairwise all-to-all of the full
//   gradient, (n-1)·|dK32| per rank each). Holds full K/V.
// local: every rank runs the whole layer unsharded (feasible where it fits); with n > 1 it first
//   all-gathers q, k, v, (n-1)·Σ comm(|X|), and dO in the backward, (n-1)·comm(|dO|).
//
// Memory per rank (bytes): input shards + output + communication buffers of the larger of the
// two passes + (training) what the forward saves for the backward. Training with
// recompute_cross_kv (LV-XAttn §3.2) saves only x, O and lse for a cross-attention layer; K/V
// are recomputed in the backward from the visual features y, one copy of which is shared by all
// cross layers (counted once per model by the planner, see shared_visual_bytes).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "src/planner/cluster_config.h"
#include "src/planner/model_config.h"

namespace lvx::planner {

enum class Strategy { kLvXattn, kRing, kStriped, kUlysses, kAllGather, kLocal };
inline constexpr std::array<Strategy, 6> kAllStrategies = {Strategy::kLvXattn,   Strategy::kRing,
                                                           Strategy::kStriped,   Strategy::kUlysses,
                                                           Strategy::kAllGather, Strategy::kLocal};
const char* to_string(Strategy s);
Strategy strategy_from_string(const std::string& s);  // throws naming the accepted names

// One attention layer's work, global sizes (batch 1).
struct LayerWorkload {
  LayerKind kind = LayerKind::kSelf;
  int64_t sq = 0;   // query tokens (text)
  int64_t skv = 0;  // key/value tokens (text for self, frames·tokens for cross)
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t hidden_size = 0;         // width of x (queries' input), for saved activations
  int64_t visual_feature_dim = 0;  // width of y (cross layers), for recomputation
  MaskRule mask = MaskRule::kNone;
  double density = 1.0;  // fraction of visible (query, key) pairs, in (0, 1]
  int64_t elem_bytes = 2;
  std::string dtype = "bf16";
};

struct CostOptions {
  bool train = false;
  bool recompute_cross_kv = true;  // LV-XAttn §3.2 activation recomputation (training)
  // Paper accounting (for comparing with LV-XAttn's measurements): its implementations expand
  // K/V to the query heads before distributing them, and compute masked attention densely.
  bool expand_kv_heads = false;
  bool skip_masked_tiles = true;
  // Device memory taken by everything but attention (weights, optimizer state, other layers'
  // activations): a strategy fits in device memory minus this.
  double reserved_bytes = 0;
};

// Per-rank tensor sizes in bytes for n ranks (see the notation above).
struct ShardBytes {
  double q = 0, k = 0, v = 0, o = 0, o32 = 0, lse = 0, dq32 = 0, dk32 = 0, dv32 = 0;
  double x = 0;  // saved input of a cross layer under recomputation: sq·hidden·e
  double y = 0;  // this rank's share of the visual features: skv·visual_feature_dim·e
};
ShardBytes shard_bytes(const LayerWorkload& w, int64_t n, const CostOptions& opt);

// Bytes one rank sends in the forward and backward pass (the volumes listed above).
struct Volume {
  double forward = 0;
  double backward = 0;
};
Volume comm_volume(Strategy s, const ShardBytes& b, int64_t n);

// The link a ring over ranks 0..n-1 (filling nodes in order) waits on every round.
Link ring_link(const ClusterConfig& c, int64_t n);
// comm(B) on a link: α + B/β, 0 for B = 0.
double transfer_time(const Link& l, double bytes);
// Time of an all-to-all in which every rank holds `bytes` split evenly over the n ranks.
double all_to_all_time(const ClusterConfig& c, int64_t n, double bytes);

struct StrategyCost {
  Strategy strategy = Strategy::kLocal;
  bool feasible = true;
  std::string reason;  // why infeasible, empty otherwise
  double fwd_s = 0, bwd_s = 0;
  double fwd_compute_s = 0, bwd_compute_s = 0;  // compute on the critical path
  double fwd_comm_s = 0, bwd_comm_s = 0;        // communication time if nothing overlapped
  Volume bytes_sent;                            // per rank
  double mem_bytes = 0;                         // per rank while this layer runs
  double saved_bytes = 0;                       // per rank, kept from forward to backward
  std::string bound;                            // "compute", "communication" or "-"
};

// Cost of running layer `w` with strategy `s` on the first n ranks of cluster `c`.
StrategyCost estimate(Strategy s, const LayerWorkload& w, const ClusterConfig& c, int64_t n,
                      const CostOptions& opt);

}  // namespace lvx::planner
