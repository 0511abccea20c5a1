// Analytic cost model of one attention layer under each distributed strategy: forward and
// backward time (compute, communication per round with overlap, per-message latency) and memory
// per rank. Pure functions of (layer workload, cluster, rank count, options); no I/O.
//
// One description per strategy (attention::Strategy::schedule, src/attention/strategy.h): for
// every rank and pass, the (query shard, key shard) pair computed in each round and every message
// posted, in exact bytes. The cost model prices exactly those, so its bytes are the runtime's.
//
// Compute (FlashAttention FLOP convention, Dao 2024; LV-XAttn Table 1): a round costs
// c + 4·P·H·D / F_fwd + T·H·t + M·H·m forward (10·P·H·D / F_bwd backward), with c, t and m the
// calibrated costs of a kernel call, of a computed tile and the extra of a partly masked tile
// (all 0 in nominal configs), T and M the computed and the partly masked tiles of the block in
// the CPU kernels' tile grid (PairCounter::tiles), P = the visible (query, key) pairs of
// its block pair, counted from the layer's actual mask metadata (kernels::visible_pairs; causal
// positions through the strategy's layouts; media indices from the prompt layout), H = the heads
// the round computes (Hq, or Hq/n for ulysses). Tiles with no visible pair are skipped by the
// kernels (CostOptions::skip_masked_tiles = false counts every pair, the papers' accounting).
//
// Communication: comm(B) = α + B/β for B > 0 bytes. Point-to-point messages (ring hops,
// distflash's messages) are priced on the link between the two ranks (nodes of gpus_per_node
// consecutive ranks), a rank's intra- and inter-node bytes of one round moving at once. Rounds
// are synchronous, so a flat ring spanning nodes waits on its inter-node hop every round; the
// double ring (topology_aware_ring) crosses nodes once per node cycle, and a message that spans
// several rounds (Message::span) only delays them by what they do not hide. All-to-all: a
// rank's chunks to other nodes share the node's inter-node link with the node's other GPUs. A
// ring all-gather of B bytes is n−1 hops of B/(n−1) on the slowest link.
//
// Time. Ring rounds overlap each round's compute with the messages of that round and are
// synchronous across ranks (a round ends when its slowest rank is done) — LV-XAttn eq. (1) for
// LV-XAttn, eq. (2) for Ring Attention, with per-rank load:
//   T = Σ_{t=0}^{n} max_r max(f_{r,t}, comm(bytes posted by r in round t))     (f_{r,n} = 0)
// so load imbalance (contiguous causal ring; media masks with unevenly spread frames) is in the
// prediction. Collectives (ulysses' all-to-alls, all_gather's gathers and reduce-scatters) are not
// overlapped: T = Σ_messages max_r comm(m) + max_r Σ_t f_{r,t}.
//
// Memory per rank (bytes): input shards + output + communication buffers of the larger of the
// two passes + (training) what the forward saves for the backward, by the strategy's saved form
// (attention::SavedForm). Training with recompute_cross_kv (LV-XAttn §3.2) saves only x, O and
// lse for a cross-attention layer; K/V are recomputed in the backward from the visual features y,
// one copy of which is shared by all cross layers (counted once per model by the planner, see
// shared_visual_bytes).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <utility>

#include "src/attention/strategy.h"
#include "src/planner/cluster_config.h"
#include "src/planner/model_yaml.h"

namespace lvx::planner {

using attention::StrategyKind;

// Counts visible (query, key) pairs of one layer's mask for any pair of shards, memoized (every
// strategy and every layer of the same shape asks for the same pairs).
class PairCounter {
 public:
  // Causal (positions, last query aligned with the last key), none, or media with the layer's
  // global metadata q_media int32 [1, Sq] and kv_media int32 [1, Skv].
  PairCounter(MaskRule rule, int64_t sq, int64_t skv, at::Tensor q_media = {},
              at::Tensor kv_media = {});
  // Pairs between the tokens at global positions q_pos and k_pos (int64 [n]).
  int64_t count(const at::Tensor& q_pos, const at::Tensor& k_pos);
  // Pairs of a schedule block: shards of `q_layout` / `kv_layout` (−1: the whole sequence).
  int64_t count(const attention::Layout& q_layout, int q_block, const attention::Layout& kv_layout,
                int kv_block);
  // Tiles (per head) of the CPU kernels' tile grid that such a block computes: partly visible
  // ones (computed whole, then masked entry by entry) and fully visible ones; empty tiles are
  // skipped (kernels::classify_tile).
  struct Tiles {
    int64_t partial = 0, full = 0;
  };
  Tiles tiles(const attention::Layout& q_layout, int q_block, const attention::Layout& kv_layout,
              int kv_block);
  int64_t total();  // every visible pair of the layer
  MaskRule rule() const { return rule_; }
  const at::Tensor& q_media() const { return q_media_; }    // media layers: int32 [1, Sq]
  const at::Tensor& kv_media() const { return kv_media_; }  // media layers: int32 [1, Skv]

 private:
  MaskRule rule_;
  int64_t sq_, skv_;
  at::Tensor q_media_, kv_media_;
  using BlockKey = std::tuple<int, int, int, int>;  // (q layout, q block, kv layout, kv block)
  static BlockKey block_key(const attention::Layout& q_layout, int q_block,
                            const attention::Layout& kv_layout, int kv_block);
  std::pair<at::Tensor, at::Tensor> block_positions(const attention::Layout& q_layout, int q_block,
                                                    const attention::Layout& kv_layout,
                                                    int kv_block) const;
  kernels::AttentionMask mask_for(const at::Tensor& q_pos, const at::Tensor& k_pos) const;
  std::map<BlockKey, int64_t> memo_;
  std::map<BlockKey, Tiles> tiles_memo_;
};

// One attention layer's work, global sizes (batch 1).
struct LayerWorkload {
  LayerKind kind = LayerKind::kSelf;
  int64_t sq = 0;   // query tokens (text)
  int64_t skv = 0;  // key/value tokens (text for self, frames·tokens for cross)
  // Cross layers: visual tokens per frame. The runtime splits the visual keys in whole frames
  // striped across the ranks (models::media_layout); the planner prices that layout.
  int64_t kv_unit = 1;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t hidden_size = 0;         // width of x (queries' input), for saved activations
  int64_t visual_feature_dim = 0;  // width of y (cross layers), for recomputation
  MaskRule mask = MaskRule::kNone;
  // Visible pairs of this layer's mask (shared by layers of the same shape); null: dense, or
  // causal positions.
  // Made on first use for dense and causal layers (mutable: a cache of the workload's shape).
  mutable std::shared_ptr<PairCounter> pairs;
  int64_t elem_bytes = 2;
  std::string dtype = "bf16";
  double density() const;  // fraction of (query, key) pairs that are visible
  PairCounter& counter() const;
};

struct CostOptions {
  bool train = false;
  bool recompute_cross_kv = true;  // LV-XAttn §3.2 activation recomputation (training)
  // Paper accounting (for comparing with LV-XAttn's measurements): its implementations expand
  // K/V to the query heads before distributing them, and compute masked attention densely.
  bool expand_kv_heads = false;
  bool skip_masked_tiles = true;
  // Ring strategies across nodes run BurstAttention's double ring (attention::AttentionSpec::
  // node_size = gpus_per_node), as the runtime does under a multi-node launcher; false: a flat
  // ring over all ranks, whose every round waits on the inter-node hop.
  bool topology_aware_ring = true;
  // The layout of the text, i.e. of every cross layer's queries: the runtime shards the text
  // once for all layers, striped when any self layer runs striped (models::resolve_layouts), so
  // the cross layers' strategies (lv_xattn, ring, ...) get striped query blocks, which balance a
  // media mask as they balance a causal one. plan() sets it from its self-layer choices.
  attention::LayoutKind text_layout = attention::LayoutKind::kContiguous;
  // Device memory taken by everything but attention (weights, optimizer state, other layers'
  // activations): a strategy fits in device memory minus this.
  double reserved_bytes = 0;
};

// The LV-XAttn paper's implementations (`lvx plan --paper-accounting`, tests/test_planner_paper):
// K/V expanded to the query heads, masked attention computed densely, and its Ring Attention one
// flat ring over every GPU (no double ring across nodes). Other fields are kept from `base`.
CostOptions paper_accounting(CostOptions base = {});

// Per-rank tensor sizes in bytes for n ranks (averages over ranks; memory estimates).
struct ShardBytes {
  double q = 0, k = 0, v = 0, o = 0, o32 = 0, lse = 0, dq32 = 0, dk32 = 0, dv32 = 0;
  double x = 0;  // saved input of a cross layer under recomputation: sq·hidden·e
  double y = 0;  // this rank's share of the visual features: skv·visual_feature_dim·e
};
ShardBytes shard_bytes(const LayerWorkload& w, int64_t n, const CostOptions& opt);

// The attention call a layer makes (batch 1; K/V heads expanded under the paper accounting).
attention::AttentionSpec layer_spec(const LayerWorkload& w, const CostOptions& opt);
// The same on cluster `c`: with the node size the ring strategies see there (the double ring,
// when opt.topology_aware_ring), as estimate() prices the layer.
attention::AttentionSpec layer_spec(const LayerWorkload& w, const ClusterConfig& c,
                                    const CostOptions& opt);

// Bytes the busiest rank sends in the forward and backward pass (the schedules' messages).
struct Volume {
  double forward = 0;
  double backward = 0;
};

// The link a ring over ranks 0..n-1 (filling nodes in order) waits on every round.
Link ring_link(const ClusterConfig& c, int64_t n);
// comm(B) on a link: α + B/β, 0 for B = 0.
double transfer_time(const Link& l, double bytes);
// Time of an all-to-all in which a rank sends `bytes_sent` in total, split evenly over the
// other n−1 ranks.
double all_to_all_time(const ClusterConfig& c, int64_t n, double bytes_sent);

struct StrategyCost {
  StrategyKind strategy = StrategyKind::kLvXAttn;
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
StrategyCost estimate(StrategyKind s, const LayerWorkload& w, const ClusterConfig& c, int64_t n,
                      const CostOptions& opt);

}  // namespace lvx::planner
