// Local (single-rank) exact attention kernels used by every distributed strategy.
//
// Layouts (global token order is the caller's business; the kernel sees local blocks):
//   q [B, Sq, Hq, D], k and v [B, Skv, Hkv, D] with Hq % Hkv == 0 (GQA/MQA: query head h uses
//   K/V head h / (Hq / Hkv); K/V are never expanded in memory).
//   o [B, Sq, Hq, D] in the accumulation dtype (float32 for bf16/fp16/fp32 inputs, float64 for
//   float64), lse [B, Hq, Sq] in the same accumulation dtype.
// Math (NOTES.md §0; FlashAttention-2; BurstAttention Alg. 1/2):
//   S = scale·Q·Kᵀ, masked entries −inf; lse = log Σ_j exp(S_ij); O = Σ_j exp(S_ij − lse_i)·V_j.
//   A row that sees no key gets lse = −inf and o = 0 (never NaN).
// Backward takes the FINAL global lse and delta = rowsum(dO ∘ O) (NOTES.md §7.2):
//   P = exp(S − lse), dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P ∘ (dP − delta), dQ = scale·dS·K,
//   dK = scale·dSᵀ·Q, with dK/dV summed over the query heads of each K/V head group.
// Who computes what (kernels/registry.cpp picks by q's device):
//   bf16/fp16/fp32, CPU and CUDA: ONE plan for both devices (kernels/attention_fused.{h,cpp}) on
//     ATen's fused attention, which returns the natural-log lse in fp32. The visible key range
//     of each query tile is found from per-tile mask metadata on the host (no .item()); runs of
//     fully visible tiles are one fused call without a mask, the other runs a fused call with
//     an additive −inf mask (or is_causal when the run is exactly top-left causal), tiles
//     outside the range are skipped. Runs merge in fp32; the op rounds a run's O once to the
//     input dtype. GQA: one call per query head of a K/V group on strided K/V views (K/V are
//     never copied per head). Backward: the op derives delta from the O it is given; lvx passes
//     O' with rowsum(dO ∘ O') = delta. Only the op call differs per device (FusedOps):
//       CPU:  at::_scaled_dot_product_flash_attention_for_cpu and its _backward, every call.
//       CUDA: at::_scaled_dot_product_flash_attention (+ _backward) for bf16/fp16 calls without
//             a mask (is_causal only when square); at::_scaled_dot_product_efficient_attention
//             (+ _backward) for fp32, masked (attn_bias) and non-square causal calls.
//     The CUDA fused path has compiled but NOT yet run on a GPU (none was available when it was
//     written); tests/gpu/run.sh is its gate (fp64 references, and the GEMM path beside it).
//   CUDA blocks ATen's kernels cannot take (head dim not a multiple of 8 or above 256, an
//     unaligned q/k/v, bf16 below sm80, a GPU outside sm50–sm121: cuda_fused_unsupported), and
//     every block with LVX_CUDA_ATTENTION=gemm: lvx's GEMM path (attention_gemm.cpp: cuBLAS
//     products, lvx's chunked mask and fused softmax passes, softmax_chunk.cu).
//   lvx's own blockwise kernels still serve fp64 on both devices (the exact path the gate's
//     fp64 numbers are taken through; ATen's CPU op accepts fp64 too, its CUDA ops do not),
//     empty blocks on CUDA, and any dtype with LVX_CPU_ATTENTION=kernel (CPU,
//     attention_{fwd,bwd}_cpu.cpp) or LVX_CUDA_ATTENTION=kernel (CUDA, attention_{fwd,bwd}.cu).
//   On CPU, which path serves a block is chosen per shape from `lvx calibrate`'s measurement of
//     the fused and GEMM paths (kernels/cpu_path.h).
// The CPU kernel never materializes more than one tile of scores per thread, so 1k queries
// against 1M keys run in a few GB; tiles whose every entry is masked are skipped.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace lvx::kernels {

// Which keys each query sees. Every mask is given in terms of per-token metadata of this
// rank's blocks, so the same kernel serves contiguous, striped and uneven shardings.
enum class MaskKind {
  kNone,    // every query sees every key
  kCausal,  // query sees key iff k_pos[j] <= q_pos[i] (global positions; striped layouts and
            // Sq != Skv alignment are expressed through the positions themselves)
  kMedia,   // cross-attention media mask, see MediaRule
};

enum class MediaRule {
  kImmediate,  // OpenFlamingo: visible iff kv_media[j] == q_media[i]
  kUpTo,       // mPLUG-Owl3:  visible iff kv_media[j] <= q_media[i]
};

struct AttentionMask {
  MaskKind kind = MaskKind::kNone;
  at::Tensor q_pos;  // kCausal: int64 [Sq] global position of each local query
  at::Tensor k_pos;  // kCausal: int64 [Skv] global position of each local key
  MediaRule media_rule = MediaRule::kImmediate;
  at::Tensor q_media;   // kMedia: int32 [B, Sq], most recent media index of each query (−1 none:
                        // the query sees nothing and gets a zero output)
  at::Tensor kv_media;  // kMedia: int32 [B, Skv], media index of each key (−1: seen by nobody)
  at::Tensor kv_valid;  // optional padding mask, bool [B, Skv] (false = padding, never seen)
  // kMedia only: a query whose q_media is −1 sees EVERY key instead of none (kv_media −1
  // included; padding, kv_valid false, still excluded). Llama-3.2-Vision (Hugging Face
  // MllamaTextCrossAttention) gives a text row that sees no image an all-zero additive bias, so
  // its softmax spreads over all visual keys; the model then zeroes that row's MLP branch.
  bool unmatched_sees_all = false;
};

struct AttentionParams {
  double scale = 0;  // softmax scale; 0 means 1/sqrt(D)
  AttentionMask mask;
};

struct AttentionOutput {
  at::Tensor o;    // [B, Sq, Hq, D], accumulation dtype
  at::Tensor lse;  // [B, Hq, Sq], accumulation dtype; −inf for rows that see no key
};

struct AttentionGrads {
  at::Tensor dq;  // [B, Sq, Hq, D], accumulation dtype
  at::Tensor dk;  // [B, Skv, Hkv, D], accumulation dtype
  at::Tensor dv;  // [B, Skv, Hkv, D], accumulation dtype
};

// What the blockwise kernels did (for tests and benchmarks): tiles are (query tile x key tile)
// pairs per (batch, query head); a skipped tile had no visible entry (decided from per-tile
// min/max of the mask metadata, never by scanning entries), a full tile needed no mask.
struct AttentionStats {
  int64_t tiles_total = 0;    // all (query tile, key tile) pairs considered
  int64_t tiles_skipped = 0;  // pairs with no visible entry: no matmul, no softmax
  int64_t tiles_full = 0;     // pairs every entry of which is visible (lvx's kernels build no
                              // mask for them; the fused path calls ATen without a mask)
  int64_t tiles_fused = 0;    // pairs computed by ATen's fused attention (0 on lvx's kernels)
  // Forward calls of the CUDA fused path by the ATen kernel that served them (0 elsewhere):
  // _scaled_dot_product_flash_attention and _scaled_dot_product_efficient_attention.
  int64_t calls_flash = 0, calls_efficient = 0;
};

// Accumulation dtype for an input dtype: float64 → float64, anything else → float32.
at::ScalarType accumulation_dtype(at::ScalarType input);

// Blockwise forward (CPU or CUDA by q's device). Shapes and dtypes are checked with messages
// naming the tensor, the expected and the actual value.
AttentionOutput attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const AttentionParams& params);
// Same, and adds what the kernel did to *stats (when not null).
AttentionOutput attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const AttentionParams& params, AttentionStats* stats);

// Blockwise backward for one (Q block, K/V block) pair with the final global lse and delta
// ([B, Hq, Sq], accumulation dtype). dout has q's shape (any float dtype).
AttentionGrads attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& dout, const at::Tensor& lse,
                                  const at::Tensor& delta, const AttentionParams& params);
AttentionGrads attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& dout, const at::Tensor& lse,
                                  const at::Tensor& delta, const AttentionParams& params,
                                  AttentionStats* stats);

// delta = rowsum(dO ∘ O) as [B, Hq, Sq] in the accumulation dtype.
at::Tensor attention_delta(const at::Tensor& dout, const at::Tensor& o);

// Merges a partial result into an accumulator in place (NOTES.md §0, pure-LSE form):
//   lse = max + log(exp(lse_acc − max) + exp(lse_new − max)),
//   o_acc = o_acc·exp(lse_acc − lse) + o_new·exp(lse_new − lse).
// Stable for rows empty in either or both: −inf (and +inf, the flash-attn convention for empty
// rows) carries zero weight; a row empty in both stays lse = −inf, o = 0. Both in fp32/fp64.
void merge_attention_states(at::Tensor& o_acc, at::Tensor& lse_acc, const at::Tensor& o_new,
                            const at::Tensor& lse_new);

// Dense reference: materializes S in `compute_dtype` (float64 for the exact reference, the input
// dtype for the same-precision reference) with the visibility matrix `visible` (bool
// [B, Sq, Skv], true = query sees key; given by the caller, so tests can build it independently
// of the kernels' mask code) and softmax scale `scale` (0: 1/sqrt(D)). Returns o [B,Sq,Hq,D] and
// lse [B,Hq,Sq] in compute_dtype. For tests and benchmarks only.
AttentionOutput attention_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& visible, double scale,
                                    at::ScalarType compute_dtype);

// The boolean visibility matrix [B, Sq, Skv] the mask implies (true = query sees key).
at::Tensor mask_matrix(const AttentionMask& mask, int64_t batch, int64_t sq, int64_t skv);
// The number of visible (query, key) pairs, summed over the batch, without building the matrix
// (sorting and binary search: O((Sq + Skv) log Skv)); the cost model's compute count.
int64_t visible_pairs(const AttentionMask& mask, int64_t batch, int64_t sq, int64_t skv);

}  // namespace lvx::kernels
