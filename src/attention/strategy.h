// Distributed exact attention: one interface, one file per strategy (nccl-tests' testColl
// pattern). Every strategy computes exactly softmax(scale·QKᵀ + mask)·V over the global
// sequences, forward and backward, and must agree with single-device attention.
//
//   lv_xattn   K/V stationary; Q, partial O (fp32) and lse rotate (LV-XAttn, Chang &
//              Venkataraman ICML'25, §3.1 and eq. (1)); backward rotates Q, dO, lse, delta and
//              the fp32 dQ accumulator while dK/dV accumulate locally (BurstAttention Alg. 2).
//   ring       Q stationary; K/V rotate (BurstAttention Alg. 1 / Ring Attention); backward
//              rotates K, V and the fp32 dK/dV accumulators, dQ local.
//   striped    ring over the striped token layout (Striped Attention, Brandon et al. §3),
//              balancing causal work.
//   distflash  DistFlashAttn's load-balanced causal schedule (Li et al., "DistFlashAttn:
//              Distributed Memory-efficient Attention for Long-context LLMs Training", §3.1
//              Alg. 2): contiguous shards; in round t ≤ ⌊n/2⌋ rank p ≥ t attends its queries to
//              the keys of p − t, and a rank p < t, already done, helps rank p − t + n with the
//              pair at distance n − t, returning (O, lse) point to point. Causal self-attention
//              only (see distflash.cpp, also for odd n, where the printed algorithm drops pairs).
//   ulysses    all-to-all from sequence to head sharding and back (DeepSpeed-Ulysses).
//   all_gather gather K/V, attend locally; backward reduce-scatters dK/dV (Llama-3 CP).
//
// One description per strategy (Strategy::schedule) says, for one rank and one pass, which
// (query shard, key shard) pair it computes in each round and every message it posts, with
// exact byte counts for uneven shards. The runtime's ring loop (ring_pipeline.h) walks those
// rounds, tests compare the measured byte counters with the schedule, and the planner's cost
// model (src/planner/cost_model.h) prices the same rounds and messages, so predicted bytes
// cannot drift from measured ones.
//
// Topology (BurstAttention, Sun et al., §3 and its double ring): with AttentionSpec::node_size L
// (1 < L < n, L divides n) the ring strategies (ring, striped, lv_xattn) run a double ring: the
// travelling blocks rotate L − 1 times inside a node, then take one hop to the same local rank of
// the next node, posted at the start of a node cycle and overlapped with all L rounds of it.
// A block's bytes are those below, and only I − 1 of its n − 1 hops cross nodes (I = n / L
// nodes); accumulators travelling behind (O/lse, dQ, dK/dV) make n + I hops instead of n: round
// the node and home once per node cycle, then one inter-node hop per node (ring_pipeline.h).
//
// Bytes sent per rank (n ranks, |X| = a block of X in its dtype, |X|₃₂ in the accumulation dtype;
// ring strategies post the next transfer before computing, so per-round time is
// max(compute, communication) as in LV-XAttn eq. (1)):
//   lv_xattn  fwd  (n−1)·|Q| + n·(|O|₃₂ + |lse|₃₂)                [Q ahead; O/lse behind, home]
//             bwd  (n−1)·(|Q| + |dO| + |lse|₃₂ + |δ|₃₂) + n·|dQ|₃₂
//   ring,     fwd  (n−1)·(|K| + |V|)
//   striped   bwd  (n−1)·(|K| + |V|) + n·(|dK|₃₂ + |dV|₃₂)         [dK/dV behind, home]
//   ulysses   fwd  Σ_{j≠r} (|Q→j| + |K→j| + |V→j| + |O→j| + |lse→j|₃₂)  (each tensor's part for j)
//             bwd  Σ_{j≠r} (|dO→j| + |dQ→j| + |dK→j| + |dV→j|)   (grads in the input dtype)
//   all_gather fwd ring all-gather of K, then of V: Σ_{j≠r+1} (|K_j| + |V_j|)
//             bwd  Σ_{j≠r} (|dK_j|₃₂ + |dV_j|₃₂)                 (reduce-scatter, pairwise)
//   distflash fwd  Σ_{t=1}^{⌊n/2⌋} [r+t<n]·|KV_r| + Σ_{t∈H} [r≥n−t]·|Q_r| + Σ_{t∈H} [r<t]·|O_o,
//   lse_o|₃₂
//             bwd  Σ_t [r+t<n]·|KV_r| + [r≥t]·|dKV_{r−t}|₃₂ + Σ_{t∈H} [r≥n−t]·|Q, dO|_r + |lse,
//             δ|₃₂_r
//                  + [r<t]·|dQ_o|₃₂      (H = {t ≤ ⌊n/2⌋ : 2t ≠ n}, the helper rounds;
//                                         o = r − t + n, the owner helped)
//
// Dtype contract (every strategy): o and the gradients come back in the input dtype, lse in the
// accumulation dtype (fp32; fp64 for fp64 inputs). Partial results that are merged or summed
// across ranks (partial O, dQ/dK/dV accumulators) travel and accumulate in the accumulation
// dtype, and are rounded once, at the end.
//
// A query row that sees no key (masked out, or every key padding) gets o = 0 and lse = −inf:
// callers tell "no key" from "a zero output" with has_keys(lse).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "src/attention/layout.h"
#include "src/dist/process_group.h"

namespace lvx::attention {

enum class StrategyKind { kLvXAttn, kRing, kStriped, kUlysses, kAllGather, kDistFlash };

std::string strategy_name(StrategyKind k);
StrategyKind strategy_from_name(const std::string& name);  // error lists the valid names
std::vector<StrategyKind> all_strategies();

// The strategies of one attention call: the forward of one and the backward of another, when the
// backward can start from what the forward saved (same saved form and layouts, see
// Strategy::saved_form), e.g. "lv_xattn+ring". A single name uses it for both passes.
struct StrategyChoice {
  StrategyKind forward = StrategyKind::kLvXAttn;
  StrategyKind backward = StrategyKind::kLvXAttn;
  StrategyChoice() = default;
  StrategyChoice(StrategyKind both) : forward(both), backward(both) {}  // NOLINT: implicit
  StrategyChoice(StrategyKind f, StrategyKind b) : forward(f), backward(b) {}
  std::string name() const;  // "ring", or "lv_xattn+ring"
  bool operator==(const StrategyChoice& o) const {
    return forward == o.forward && backward == o.backward;
  }
};
// Parses "S" or "F+B"; refuses, saying why, a pair whose backward cannot use the forward's state.
StrategyChoice strategy_choice_from_name(const std::string& name);
// True when backward strategy `b` can run from the state forward strategy `f` saved.
bool can_pair(StrategyKind f, StrategyKind b);

// Global description of one attention call; identical on every rank.
struct AttentionSpec {
  int64_t batch = 1, sq = 0, skv = 0, hq = 0, hkv = 0, head_dim = 0;
  kernels::MaskKind mask = kernels::MaskKind::kNone;
  kernels::MediaRule media_rule = kernels::MediaRule::kImmediate;
  bool unmatched_sees_all = false;  // kMedia: q_media −1 sees every key (AttentionMask's flag)
  double scale = 0;  // 0: 1/sqrt(head_dim)
  // How the shards split the tokens (striped forces striped on both sides): a model keeps its
  // text in one layout for every layer, and splits visual keys in whole images (kv_unit tokens).
  LayoutKind q_layout = LayoutKind::kContiguous;
  LayoutKind kv_layout = LayoutKind::kContiguous;
  int64_t kv_unit = 1;
  // Ranks per node (consecutive ranks share a node, as launchers number them): the ring
  // strategies run BurstAttention's double ring when 1 < node_size < n and node_size divides n.
  // 0: one node (a flat ring). dist_attention fills it from the process group (LOCAL_WORLD_SIZE).
  int64_t node_size = 0;
  // kCausal with sq != skv aligns the last query with the last key: query i sits at key
  // position i + (skv − sq).
  int64_t causal_offset() const { return skv - sq; }
  std::string describe() const;  // for agreement checks and logs
};

// Per-token mask metadata, given globally (every rank has the prompt), so no strategy ships it.
struct MaskInputs {
  at::Tensor q_media;   // int32 [B, Sq] (kMedia)
  at::Tensor kv_media;  // int32 [B, Skv] (kMedia)
  at::Tensor kv_valid;  // optional bool [B, Skv]: false = padding, seen by no query
};

// This rank's inputs: q/k/v are this rank's shards in the strategy's layouts (q_layout /
// kv_layout).
struct LocalInputs {
  at::Tensor q;  // [B, Sq_r, Hq, D]
  at::Tensor k;  // [B, Skv_r, Hkv, D]
  at::Tensor v;  // [B, Skv_r, Hkv, D]
  MaskInputs mask;
};

struct LocalOutput {
  at::Tensor o;    // [B, Sq_r, Hq, D], input dtype
  at::Tensor lse;  // [B, Hq, Sq_r], accumulation dtype; −inf where the row sees no key
};

struct LocalGrads {
  at::Tensor dq, dk, dv;  // this rank's shards, input dtype
};

// What a forward keeps for its backward; opaque to callers (the autograd function saves these
// tensors with save_for_backward, once). Its form is Strategy::saved_form().
struct SavedState {
  std::vector<at::Tensor> tensors;
};

// Input checks shared by every entry point (CLI, C++ and Python APIs), so a mistake reads the
// same everywhere; `where` starts each message (a file name, "lvx.attention"). check_qkv: q, k, v
// are [B, S, H, D] (whole tensors or this rank's shards), k and v alike, batch, head dim and
// dtype shared, Hkv dividing Hq. check_mask_inputs: the global mask metadata against the spec
// (q_media/kv_media int32 [B, Sq]/[B, Skv], required for kMedia; kv_valid bool [B, Skv]).
void check_qkv(const std::string& where, const at::Tensor& q, const at::Tensor& k,
               const at::Tensor& v);
void check_mask_inputs(const std::string& where, const AttentionSpec& s, const MaskInputs& m);

// `s` with node_size taken from the launcher (LOCAL_WORLD_SIZE) when the caller left it 0.
AttentionSpec with_topology(AttentionSpec s, const dist::ProcessGroup& pg);

// bool [B, Hq, Sq_r]: the rows that saw at least one key (lse > −inf).
at::Tensor has_keys(const at::Tensor& lse);

// ---- the description shared by the runtime and the cost model ---------------------------

struct Volume {
  int64_t sent = 0, received = 0;
};

// One message (group) this rank posts in a pass.
struct Message {
  enum Op { kRingHop, kAllToAll, kAllGatherRing };
  std::string what;  // "Q", "O/lse", "K/V", "dK", …
  Op op = kRingHop;
  // Ring strategies: the compute round it overlaps with (a block posted ahead for round t+1
  // travels during round t; a partial result of round t travels during round t+1; round n is
  // the trip home after the last compute). −1: a collective before or after the compute.
  int round = -1;
  int64_t sent = 0, received = 0;  // this rank's bytes
  // The rank it goes to (point-to-point messages; −1: a collective over every rank), so that the
  // cost model can price it on the link between the two ranks (intra- or inter-node).
  int peer = -1;
  // Rounds it overlaps, from `round` on: 1 for a ring hop; a double ring's inter-node hop is
  // posted at the start of a node cycle and overlaps every round of it.
  int span = 1;
};

// The (query shard, key shard) pair of one compute round: ranks whose shards (in the strategy's
// layouts) meet; −1 means the whole sequence.
struct Block {
  int q = -1, kv = -1;
  static Block none() { return {-2, -2}; }  // an idle round (distflash ranks with no work left)
  bool idle() const { return q == -2; }
};

struct PassSchedule {
  std::vector<Block> rounds;
  int64_t head_divisor = 1;  // ulysses computes Hq/n heads of the whole sequence
  std::vector<Message> messages;
  Volume volume() const;  // sum of the messages
};

// The form of the saved state: a backward can start from a forward's state iff the forms and
// the layouts match.
enum class SavedForm {
  kShards,      // q, k, v, o, lse: this rank's shards in the strategy's layouts
  kHeadShards,  // ulysses: head-sharded whole-sequence q, k, v, o, lse
  kGatheredKV,  // all_gather: q, the gathered k and v, o, lse
};

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual StrategyKind kind() const = 0;
  std::string name() const { return strategy_name(kind()); }
  virtual Layout q_layout(const AttentionSpec& s, int world) const;
  virtual Layout kv_layout(const AttentionSpec& s, int world) const;
  virtual SavedForm saved_form() const { return SavedForm::kShards; }
  // Refuses, with a message saying why, specs this strategy cannot run (e.g. heads that do not
  // divide by the number of ranks for ulysses).
  virtual void check_supported(const AttentionSpec& s, int world) const {}

  // Strategies hold no state: everything the backward needs is in `saved` (filled when not
  // null), so one object serves any number of interleaved calls.
  virtual LocalOutput forward(dist::ProcessGroup& pg, const AttentionSpec& s, const LocalInputs& in,
                              SavedState* saved) const = 0;
  // `saved` is what this strategy's forward (or a pairable one's, see can_pair) saved; `mask`
  // the same metadata as in the forward; dout has the output shard's shape (any float dtype).
  // dlse (optional, [B, Hq, Sq_r]) is a gradient with respect to lse, for callers that merge
  // partial results by their lse (BurstAttention's blockwise merge across strategies): it enters
  // as a shift of delta, dS = P ∘ (dP − (delta − dlse)) (see backward_delta). With dlse, ulysses
  // sends one more all-to-all (of |lse|) than its schedule lists.
  virtual LocalGrads backward(dist::ProcessGroup& pg, const AttentionSpec& s,
                              const MaskInputs& mask, const SavedState& saved,
                              const at::Tensor& dout, const at::Tensor& dlse = {}) const = 0;

  // This rank's rounds and messages in one pass (element size from `dtype`).
  virtual PassSchedule schedule(const AttentionSpec& s, int world, int rank, at::ScalarType dtype,
                                bool backward) const = 0;
  Volume analytic_bytes(const AttentionSpec& s, int world, int rank, at::ScalarType dtype,
                        bool backward) const {
    return schedule(s, world, rank, dtype, backward).volume();
  }
};

std::unique_ptr<Strategy> make_strategy(StrategyKind k);

// This rank's q and k shards hold the tokens the strategy's layouts give it (a group of another
// size than the one the shards were cut for, or uneven shards with the wrong global lengths).
void check_local_shards(const std::string& where, const AttentionSpec& s, const Strategy& strategy,
                        int world, int rank, const at::Tensor& q, const at::Tensor& k);

// ---- helpers shared by the strategies ----------------------------------------------------

// Kernel parameters for (queries at global positions q_pos) × (keys at k_pos): the mask metadata
// is sliced from the global tensors in `mask`.
kernels::AttentionParams block_params(const AttentionSpec& s, const MaskInputs& mask,
                                      const at::Tensor& q_pos, const at::Tensor& k_pos);

int64_t element_bytes(at::ScalarType t);

// delta = rowsum(dO ∘ O) − dlse ([B, Hq, Sq], accumulation dtype): the backward's row term, with
// the lse gradient folded in (d lse_i / d S_ij = P_ij).
at::Tensor backward_delta(const at::Tensor& dout, const at::Tensor& o, const at::Tensor& dlse);

}  // namespace lvx::attention
