// Generation across ranks: the KV cache a prefill leaves on each rank, and pass-Q decoding.
//
// After a distributed prefill every rank keeps the keys and values it computed: its shard of
// the prompt's text K/V (self-attention, in the text layout) and its own images' visual K/V
// (cross-attention, whole images). Nothing is gathered. A decode step runs the new token
// replicated on every rank (one token: projections and MLPs are cheap) and, per attention, sends
// the QUERY to the keys instead of the keys to the query (the idea of LV-XAttn, "LV-XAttn:
// Distributed Cross-Attention for Long Visual Inputs in Multimodal Large Language Models", §3.1,
// at Sq = 1):
//   each rank r:  s_r = q·K_rᵀ·scale,  lse_r = logsumexp(s_r),  o_r = softmax(s_r)·V_r
//   all-gather (o_r, lse_r) of every attention of the layer in ONE message,
//   merge:        lse = log Σ_r exp(lse_r),  o = Σ_r exp(lse_r − lse)·o_r   (blockwise softmax,
//                 BurstAttention, "BurstAttention: An Efficient Distributed Attention Framework
//                 for Extremely Long Sequences", Eq. 3)
// The generated tokens' own K/V are replicated (every rank computed them) and every rank adds
// their partial locally after the merge, so each holds identical logits.
//
// Bytes per decoded token, per rank, per layer: (n−1)·A·B·Hq·(D+1)·4 with A attentions in the
// layer (1, or 2 in a layer with cross-attention), n ranks (ring all-gather: each rank forwards
// n−1 pieces). That is one message when the layer's attentions read the same input (mPLUG-Owl3);
// where one feeds the next (OpenFlamingo's gated block before the decoder layer) each merges on
// its own, with its own Hq and D (models/openflamingo/model.h). Gathering K/V instead would move
// (n−1)/n of the layer's visual K/V to every rank once (2·B·S_vis·Hkv·D·dtype bytes) and then hold
// it all on every rank, which lvx never does.
//
// A generation stepped alone may instead decode on rank 0 only, with messages only at the cross
// layers (models/lead_decode.h, lvx qa's default); lvx serve's batched rows decode as above.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <vector>

#include "kernels/attention.h"
#include "models/parallel.h"
#include "models/row_key_pool.h"
#include "src/attention/media_mask.h"
#include "src/dist/process_group.h"

namespace lvx::models {

// One attention's result over some keys: o [B, Hq, D] and lse [B, Hq] in the accumulation dtype
// (fp32; fp64 for fp64 inputs), o = 0 and lse = −inf where no key is visible.
struct Partial {
  at::Tensor o, lse;
};

// One cross-attention call of a decode step: the layer whose visual keys it reads, its query's
// heads and head size, and the softmax scale. A family lists them in the order its decode_step
// makes them (Model::decode_cross_calls); a call runs only where the cache has visual keys in
// that layer (KVShard::k defined), which is the same on every rank.
struct CrossCall {
  int64_t layer = 0;
  int64_t heads = 0, head_dim = 0;
  double scale = 1;
};

// q [B, Hq, D] against k/v [B, S, Hkv, D] (GQA: query head h reads key head h / (Hq/Hkv)),
// keys with visible[b, s] false skipped (undefined: all visible): the kernels'
// attention_forward (kernels/attention.h) with one query per row and `visible` as its kv_valid.
Partial partial_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& visible, double scale);

// partial_attention of G rows' queries q [G, Hq, D] against keys they all share (k/v [1, S, Hkv,
// D], visible [1, S] or undefined: a video's cached prompt prefix and visual K/V, which rows
// about one video hold as the same tensors) in one call: the rows are the G queries of one
// sample, none masked from another key. Returns [G, Hq, D] / [G, Hq], row r's at [r].
Partial shared_partial_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& visible, double scale);

// Merges partial results over disjoint key sets with the kernels' merge_attention_states, in
// order (exact; rows without keys stay o = 0, −inf).
Partial merge_partials(const std::vector<Partial>& parts);

// A partial as one message, [..., D + 1]: o, then lse as the last channel (what pass-Q and lead
// decoding send), and back (views of `packed`).
at::Tensor pack_partial(const Partial& p);
Partial unpack_partial(const at::Tensor& packed);

// Pass-Q: all-gathers this rank's partials (every attention of one layer, one message) and
// merges each over the ranks, in rank order (identical on every rank).
std::vector<Partial> merge_across_ranks(dist::ProcessGroup& pg, const std::vector<Partial>& local);

// Bytes one rank sends for merge_across_ranks of `attentions` partials of [B, Hq, D].
int64_t pass_q_bytes(int world, int64_t attentions, int64_t batch, int64_t heads, int64_t head_dim);

// What one attention of one layer keeps on this rank.
struct KVShard {
  at::Tensor k, v;     // [B, S_r, Hkv, D]
  at::Tensor visible;  // bool [B, S_r] for every later token, or undefined (all)
};

// A shard's `visible` from its keys' validity `valid` (bool [B, S_r]): undefined when every key
// is valid, so that the kernels plan its calls without a mask (a mask's plan is ~20 small host
// ops per call, at every decode step); else `valid` (and on meta). One host read, when the
// shard is cached.
at::Tensor shard_visible(const at::Tensor& valid);

// The visual shard a cache keeps for a cross layer: k and v made contiguous once here (a fused
// K/V projection's select or chunk is a strided view, and kernels::attention_forward copies a
// strided K/V whole at every call: every prefill chunk and every decode step would copy the
// video's keys again; measured as a third of a 1-hour prompt's chunk, docs/serve.md).
KVShard visual_shard(const at::Tensor& k, const at::Tensor& v, const at::Tensor& visible);

// extend's T new tokens per sample (models/model.h) as extra query heads: q [B, T, Hq, D] →
// [B, Hkv·T·g, D] with g = Hq/Hkv, head j·T·g + t·g + i reading K/V head j under the kernels' GQA
// mapping, so cached keys take all T queries in one call per rank and one pass-Q message per
// layer. unfold_tokens turns such a partial back into o [B, T, Hq, D] and lse [B, T, Hq].
at::Tensor fold_tokens(const at::Tensor& q, int64_t kv_heads);
Partial unfold_tokens(const Partial& folded, int64_t tokens, int64_t kv_heads);

// T new queries q [B, T, Hq, D] against the new keys nk/nv [B, before + T, Hkv, D] (the tokens
// since the prompt's cached part, then their own), causal: token t sees keys [0, before + t].
// The kernels' blockwise attention (memory linear in T); o [B, T, Hq, D], lse [B, T, Hq] in the
// accumulation dtype.
Partial causal_new_keys(const at::Tensor& q, const at::Tensor& nk, const at::Tensor& nv,
                        int64_t before, double scale);

// A partial of T tokens per sample (o [B, T, Hq, D], lse [B, T, Hq]) as B·T rows, the shape
// merge_partials takes.
Partial token_rows(const Partial& p);

// One cross-attention call's visibility while a prompt is prefilled in chunks
// (Model::prefill_media; kernels/attention.h's media mask): a family has one call, or several
// where one comparison cannot say which keys a row sees (Llama-3.2-Vision's nested tile sets,
// models/mllama/mask.h: every row sees keys in one call only, the others give o = 0).
struct PromptMedia {
  at::Tensor q_media;   // int32 [B, L]: each prompt position's newest visible image (−1: none)
  at::Tensor kv_media;  // int32 [B, S_r]: the image of each of this rank's visual keys (−1: pad)
  kernels::MediaRule rule = kernels::MediaRule::kUpTo;
  bool unmatched_sees_all = false;
};

// The per-rank cache of one prompt being generated from.
struct DecodeCache {
  std::vector<KVShard> prompt;  // per decoder layer: this rank's shard of the prompt's K/V
  std::vector<KVShard> visual;  // per decoder layer: this rank's visual K/V (empty k: none)
  // Rank 0 under lead decoding (models/lead_decode.h): `prompt` holds every rank's prompt keys,
  // gathered once; every rank sets it then (the others' shards are no longer read).
  bool prompt_whole = false;
  std::vector<std::vector<at::Tensor>> new_k, new_v;  // per layer: generated tokens' K/V, [B,1,..]
  // A row stepping with others (push_rows_keys) holds its generated K/V in a slot of their
  // shared pool instead: its new keys are then the slot's, followed by any pieces above.
  RowSlot pooled;
  at::Tensor sees_media;  // bool [B]: later tokens see an image (gated cross-attention)
  int64_t length = 0;     // tokens so far (prompt + generated): the next position
  int64_t batch = 0;
  double encode_seconds = 0;  // the prefill's vision encoding of this rank's frames
  // While a prompt is prefilled in chunks (Model::prefill_media, then extend per chunk): which
  // images each prompt position sees, per cross-attention call (the same in every cross layer),
  // so a chunk's tokens see the images before them, not all of them; prompt_sees: bool [B, L],
  // whether each position sees an image at all (a family's gate or masked-out rows). Empty once
  // the prompt is whole (seal_chunked_prompt) and for a whole prefill.
  std::vector<PromptMedia> prompt_media;
  at::Tensor prompt_sees;
  // Also while a prompt is prefilled in chunks: the visual keys each prompt position reads, over
  // every rank, sample and call (int64 [L] on the host; media_key_reads), the same on every
  // rank, so that all of them cut the same chunks under GenerateOptions::prefill_chunk_keys.
  at::Tensor prompt_key_reads;
};

// The visual keys each of the first `length` positions of a prompt reads under the host media
// mask `mm` of the whole prompt (every rank's keys, not one shard's), summed over the samples:
// int64 [length] on the host. A position sees all the keys of the images its q_media and the
// rule allow (kUpTo: images 0..q_media; kImmediate: image q_media); one that sees no image reads
// none, or every key with unmatched_sees_all. Padding keys (kv_media −1) count for nobody.
at::Tensor media_key_reads(const attention::MediaMask& mm, int64_t length);

// Whether `cache` holds a prompt being prefilled in chunks; checks that T tokens from its length
// stay inside it.
bool prefilling_chunks(const DecodeCache& cache, int64_t tokens);

// Queries q [B, T, Hq, D] of the prompt tokens at positions [from, from + T) being prefilled in
// chunks against this rank's visual keys `vis`, each token seeing the keys call `m` allows it:
// one kernel call with the media mask. o [B, T, Hq, D], lse [B, T, Hq].
Partial media_partial(const at::Tensor& q, const KVShard& vis, const PromptMedia& m, int64_t from,
                      double scale);

// The same for every call of `cache` (one pass-Q message), summed over the calls (each token
// sees keys in one call only): o [B, T, Hq, D] of the tokens at the cache's length.
at::Tensor media_over_ranks(const at::Tensor& q, const KVShard& vis, const DecodeCache& cache,
                            dist::ProcessGroup& pg, double scale);

// A partial of T tokens per sample (o [B, T, Hq, D], lse [B, T, Hq]) in fold_tokens' layout
// ([B, Hkv·T·g, D] / [B, Hkv·T·g]), to travel in one pass-Q message with folded ones.
Partial fold_partial(const Partial& p, int64_t kv_heads);

// The end of a prompt prefilled in chunks: the K/V its chunks left on every rank (extend's new
// keys) become this rank's shard of the prompt's K/V (a contiguous 1/n of the tokens, as a whole
// prefill leaves a shard), so decoding, extending and keeping the prefix work as after a whole
// prefill; prompt_media is dropped.
void seal_chunked_prompt(DecodeCache& cache, int rank, int world);

// The cache a whole prefill starts from (a family's forward with a cache): `layers` empty layers,
// the prompt's length L and batch B, and the seconds its vision encoding took since
// `encode_start`.
void start_prompt_cache(DecodeCache& cache, int64_t layers, int64_t B, int64_t L,
                        std::chrono::steady_clock::time_point encode_start);

// The cache Model::prefill_media starts from: `layers` layers with no prompt keys yet ([B, 0,
// Hkv, D] in `like`'s options; the chunks' keys are new keys), no visual keys, length 0.
DecodeCache chunked_prompt_cache(int64_t layers, int64_t batch, int64_t kv_heads, int64_t head_dim,
                                 const at::TensorOptions& like);

// extend's tokens checked (int64 [B, T >= 1] for the cache's B samples): returns T.
int64_t extend_length(const at::Tensor& tokens, const DecodeCache& cache);

// Several generations at once (continuous batching: Model::decode_rows, extend_rows), row r with
// its own cache caches[r] (one sample each).
//
// extend's T new tokens q [B, T, Hq, D] against keys held across the ranks (the cached prompt's
// or the visual ones): folded into heads, one call per rank, merged over the ranks (pass-Q);
// o [B, T, Hq, D], lse [B, T, Hq].
Partial tokens_over_ranks(const at::Tensor& q, const KVShard& kv, dist::ProcessGroup& pg,
                          double scale);

// The tokens layer `layer` of `cache` holds past its cached prompt part (extend's and decode's
// keys on every rank).
int64_t new_key_count(const DecodeCache& cache, size_t layer);

// Those tokens' keys and values ([B, T, Hkv, D] each). Their list (one piece per step or chunk)
// is replaced by the one tensor, so a decode step concatenates two pieces, not one per earlier
// step (at 16 rows of a small model, those concatenations were a tenth of a step).
std::pair<at::Tensor, at::Tensor> new_keys(DecodeCache& cache, size_t layer);

// Every row's new tokens' k, v [N, Hkv, D] (row r's counts[r] tokens side by side) kept as its
// generated keys in `layer`. Several rows: one pool shared by them all (models/row_key_pool.h;
// a row not yet in it moves in, its keys copied), one write per layer for all rows. One row:
// pieces in its cache, as extend keeps them (so that one row alone is extend's products).
void push_rows_keys(const std::vector<DecodeCache*>& caches, size_t layer, const at::Tensor& k,
                    const at::Tensor& v, const std::vector<int64_t>& counts);

// decode_rows' arguments checked (one token per row, int64 [R]; each cache one sample) and the
// rows' positions, each cache's length: int64 [R, 1] on `device`.
at::Tensor row_positions(const at::Tensor& tokens, const std::vector<DecodeCache*>& caches,
                         const at::Device& device);

// An order of the rows (indices into `caches`) in which the rows holding the same cached key
// tensors (questions about one cached video) sit side by side, groups in order of their first
// row, rows in their order within a group: then rows_cached_partial takes each group's tokens
// as one run (a narrow) and its outputs are already in row order (no gather, no scatter back).
std::vector<size_t> rows_by_keys(const std::vector<const DecodeCache*>& caches);

// Every row's tokens q [N, Hq, D] (row r's lengths[r] tokens side by side) over its cached keys
// (prompt, or visual): the rows that hold the same key tensors (questions about one cached video)
// in one shared_partial_attention call, their tokens gathered. Returns the partial of the rows
// that have keys (visual: the rows with images), their tokens in row order, [N', Hq, D] /
// [N', Hq]; none (undefined) when no row has any. No per-row operation: a few per group.
Partial rows_cached_partial(const at::Tensor& q, const std::vector<int64_t>& lengths,
                            const std::vector<DecodeCache*>& caches, size_t layer, bool visual,
                            double scale);
// Where the N tokens of a rows forward (extend_rows: row r's T_r tokens side by side, a decode
// step's one each) sit in the padded [R, T_max] layout of the batched product over each row's
// own new keys, and which keys each sees (causal among its row's new keys). The same in every
// layer: built once per forward.
struct RowsLayout {
  // Rows padded together: the one-token rows (decode steps), and the longer ones (questions).
  struct Part {
    std::vector<size_t> rows;
    int64_t longest = 0;   // T_max
    at::Tensor to_padded;  // int64 [R·T_max]: the flat token in slot (r, t) (padding: r's last)
    at::Tensor to_part;    // int64 [N_part]: the slot of each of the part's tokens, row order
                           // (either undefined where it is the identity)
    std::vector<int64_t> sees;  // [R·T_max]: the new keys slot (r, t) sees (its first ones)
  };
  std::vector<int64_t> lengths;  // T_r: row r's tokens in this forward
  std::vector<int64_t> before;   // its new keys before them (its question and answer so far)
  int64_t tokens = 0;            // N
  std::vector<Part> parts;
  at::Tensor to_flat;  // int64 [N]: each token's place in the parts' outputs (two parts only)
};
RowsLayout rows_layout(const std::vector<int64_t>& lengths, const std::vector<int64_t>& before,
                       const at::Device& device);
// Every token's query q [N, Hq, D] (rows side by side as `layout` says) against its own row's
// new keys up to its own (their K/V pushed for this forward): each part's rows' queries padded to
// its longest, every row reading its own pool slot (kernels::slot_attention: one call per part).
// o [N, Hq, D], lse [N, Hq].
//
// With a prompt front (prompt_front: one rank), each row's cached prompt keys come first in
// its row of the product, all visible: one softmax over the prompt's keys and the row's own,
// instead of a call over the prompt keys and a merge of the two partials. They are kept in the
// row's pool slot as its front (RowKeyPool::set_fronts: copied when the row first steps so, not
// at every step), and one call reads them with the row's own keys.
struct PromptFront {
  int64_t length = 0;                                   // P: every row's prompt keys in this layer
  std::vector<std::pair<at::Tensor, at::Tensor>> keys;  // row r's (k, v [1, P, Hkv, D])
  explicit operator bool() const { return length > 0; }
};
Partial rows_new_keys(const at::Tensor& q, const std::vector<DecodeCache*>& caches, size_t layer,
                      const RowsLayout& layout, double scale, const PromptFront& front = {});
// The rows' cached prompt keys in `layer` as a prefix of their own keys' product, where one
// product serves: one rank (a prompt split over ranks is merged across them before the rows'
// own keys join it), several rows in one pool, every row's prompt keys unmasked and of one
// shape, and the copies small (R·P·Hkv·D at most par.prompt_front_elements: each row then holds
// a copy of its prompt keys in its slot and a step gathers them, where a call per video reads
// them in place; long prompts keep that call). Else none: the caller takes rows_cached_partial
// and merges.
PromptFront prompt_front(const std::vector<DecodeCache*>& caches, size_t layer,
                         const Parallel& par);
// Every row's self-attention over its cached prompt keys and its own generated keys (a decode
// step, one query per row q [R, Hq, D]), merged over the ranks: one product with the prompt as
// a prefix where prompt_front allows, else rows_over_cache merged with generated_partial.
Partial rows_self_partial(const at::Tensor& q, const std::vector<DecodeCache*>& caches,
                          size_t layer, const Parallel& par, double scale);
// Every row's one query q [R, Hq, D] (a decode step) against its own generated keys (the tokens
// after its cached prompt part): rows_new_keys with one token per row.
Partial generated_partial(const at::Tensor& q, const std::vector<DecodeCache*>& caches,
                          size_t layer, double scale, const PromptFront& front = {});
// Every row's query q [R, Hq, D] against its own cached keys (prompt, or visual) on every rank,
// merged over the ranks: rows_cached_partial, then one pass-Q message for all rows. [R, Hq, D].
Partial rows_over_cache(const at::Tensor& q, const std::vector<DecodeCache*>& caches, size_t layer,
                        bool visual, dist::ProcessGroup& pg, double scale);

}  // namespace lvx::models
