#include "models/decode.h"

#include <algorithm>
#include <limits>

#include "kernels/attention.h"
#include "src/common/error.h"

namespace lvx::models {

namespace {

// The partial of queries that see no key: o = 0 of shape `o` and lse = −inf over all but its
// last dimension, in q's accumulation dtype.
Partial no_keys(const at::Tensor& q, at::IntArrayRef o) {
  const auto acc = q.options().dtype(kernels::accumulation_dtype(q.scalar_type()));
  return {at::zeros(o, acc),
          at::full(o.slice(0, o.size() - 1), -std::numeric_limits<double>::infinity(), acc)};
}

}  // namespace

at::Tensor shard_visible(const at::Tensor& valid) {
  if (valid.is_meta()) return valid;  // no values to read (the placement check): kept as a mask
  return valid.all().item<bool>() ? at::Tensor() : valid;
}

KVShard visual_shard(const at::Tensor& k, const at::Tensor& v, const at::Tensor& visible) {
  return {k.contiguous(), v.contiguous(), visible};
}

Partial partial_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& visible, double scale) {
  const int64_t B = q.size(0), hq = q.size(1), D = q.size(2), S = k.size(1);
  if (S == 0) return no_keys(q, {B, hq, D});  // no key on this rank (the kernels take one)
  // One query per row: q [B, 1, Hq, D] against the keys, the GQA mapping and the padding mask
  // (kv_valid) as the kernels have them; o and lse come back in the accumulation dtype.
  kernels::AttentionParams params;
  params.scale = scale;
  if (visible.defined()) params.mask.kv_valid = visible;
  const kernels::AttentionOutput out = kernels::attention_forward(q.unsqueeze(1), k, v, params);
  return {out.o.select(1, 0), out.lse.select(2, 0)};  // [B, Hq, D], [B, Hq]
}

Partial shared_partial_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& visible, double scale) {
  const int64_t G = q.size(0);
  if (G == 1 || k.size(1) == 0) return partial_attention(q, k, v, visible, scale);
  // The rows as G queries of one sample (no mask among queries: each sees every key).
  kernels::AttentionParams params;
  params.scale = scale;
  if (visible.defined()) params.mask.kv_valid = visible;
  const kernels::AttentionOutput out = kernels::attention_forward(q.unsqueeze(0), k, v, params);
  return {out.o.squeeze(0), out.lse.squeeze(0).transpose(0, 1)};  // [G, Hq, D], [G, Hq]
}

Partial merge_partials(const std::vector<Partial>& parts) {
  LVX_CHECK(!parts.empty(), "decode: nothing to merge");
  if (parts.size() == 1) return parts[0];
  // The kernels' merge over [B, Sq = 1, Hq, D] / [B, Hq, Sq = 1], in place on a copy of the first.
  at::Tensor o = parts[0].o.unsqueeze(1).clone();
  at::Tensor lse = parts[0].lse.unsqueeze(2).clone();
  for (size_t i = 1; i < parts.size(); ++i)
    kernels::merge_attention_states(o, lse, parts[i].o.unsqueeze(1), parts[i].lse.unsqueeze(2));
  return {o.select(1, 0), lse.select(2, 0)};
}

at::Tensor pack_partial(const Partial& p) { return at::cat({p.o, p.lse.unsqueeze(-1)}, -1); }

Partial unpack_partial(const at::Tensor& packed) {
  const int64_t D = packed.size(-1) - 1;
  return {packed.narrow(-1, 0, D), packed.select(-1, D)};
}

std::vector<Partial> merge_across_ranks(dist::ProcessGroup& pg, const std::vector<Partial>& local) {
  const int n = pg.world_size();
  if (n == 1) return local;
  // One message: [A, B, Hq, D + 1] (pack_partial of each).
  std::vector<at::Tensor> packed;
  for (const Partial& p : local) packed.push_back(pack_partial(p));
  const at::Tensor mine = at::stack(packed).unsqueeze(0).contiguous();  // [1, A, B, Hq, D+1]
  const at::Tensor all = pg.all_gather(mine);                           // [n, A, B, Hq, D+1]
  std::vector<Partial> merged;
  for (size_t a = 0; a < local.size(); ++a) {
    std::vector<Partial> parts;
    for (int r = 0; r < n; ++r) parts.push_back(unpack_partial(all[r][static_cast<int64_t>(a)]));
    merged.push_back(merge_partials(parts));
  }
  return merged;
}

at::Tensor fold_tokens(const at::Tensor& q, int64_t kv_heads) {
  const int64_t B = q.size(0), T = q.size(1), hq = q.size(2), d = q.size(3), g = hq / kv_heads;
  return q.view({B, T, kv_heads, g, d}).permute({0, 2, 1, 3, 4}).reshape({B, kv_heads * T * g, d});
}

Partial unfold_tokens(const Partial& folded, int64_t tokens, int64_t kv_heads) {
  const int64_t B = folded.o.size(0), d = folded.o.size(2);
  const int64_t g = folded.o.size(1) / (kv_heads * tokens), hq = kv_heads * g;
  return {folded.o.view({B, kv_heads, tokens, g, d})
              .permute({0, 2, 1, 3, 4})
              .reshape({B, tokens, hq, d}),
          folded.lse.view({B, kv_heads, tokens, g}).permute({0, 2, 1, 3}).reshape({B, tokens, hq})};
}

Partial causal_new_keys(const at::Tensor& q, const at::Tensor& nk, const at::Tensor& nv,
                        int64_t before, double scale) {
  // The kernels' blockwise causal attention (token t at position before + t, key s at s): no
  // [heads, T, S] score matrix is ever whole, so a long question's extend stays linear in memory.
  const int64_t T = q.size(1), S = nk.size(1);
  kernels::AttentionParams params;
  params.scale = scale;
  params.mask.kind = kernels::MaskKind::kCausal;
  const auto host = at::TensorOptions().dtype(at::kLong);
  params.mask.q_pos = at::arange(before, before + T, host);
  params.mask.k_pos = at::arange(S, host);
  const kernels::AttentionOutput out = kernels::attention_forward(q, nk, nv, params);
  return {out.o, out.lse.transpose(1, 2)};  // [B, T, Hq, Dv], [B, T, Hq]
}

Partial token_rows(const Partial& p) {
  const int64_t B = p.o.size(0), T = p.o.size(1);
  return {p.o.reshape({B * T, p.o.size(2), p.o.size(3)}), p.lse.reshape({B * T, p.lse.size(2)})};
}

// ---- a prompt prefilled in chunks (Model::prefill_media, then extend per chunk) ----

bool prefilling_chunks(const DecodeCache& cache, int64_t tokens) {
  if (cache.prompt_media.empty()) return false;
  const int64_t L = cache.prompt_media[0].q_media.size(1);
  LVX_CHECK(cache.length + tokens <= L, "extend: tokens ", cache.length, "..",
            cache.length + tokens, " run past the prompt being prefilled (", L, " tokens)");
  return true;
}

Partial media_partial(const at::Tensor& q, const KVShard& vis, const PromptMedia& m, int64_t from,
                      double scale) {
  const int64_t B = q.size(0), T = q.size(1), hq = q.size(2), D = q.size(3);
  if (vis.k.size(1) == 0) return no_keys(q, {B, T, hq, D});  // no image on this rank
  kernels::AttentionParams params;
  params.scale = scale;
  params.mask.kind = kernels::MaskKind::kMedia;
  params.mask.media_rule = m.rule;
  params.mask.q_media = m.q_media.narrow(1, from, T).to(vis.k.device(), at::kInt).contiguous();
  params.mask.kv_media = m.kv_media.to(at::kInt).contiguous();
  params.mask.unmatched_sees_all = m.unmatched_sees_all;
  const kernels::AttentionOutput out = kernels::attention_forward(q, vis.k, vis.v, params);
  return {out.o, out.lse.transpose(1, 2)};  // [B, T, Hq, D], [B, T, Hq]
}

at::Tensor media_over_ranks(const at::Tensor& q, const KVShard& vis, const DecodeCache& cache,
                            dist::ProcessGroup& pg, double scale) {
  const int64_t kv_heads = vis.k.size(2);
  std::vector<Partial> local;
  for (const PromptMedia& m : cache.prompt_media)
    local.push_back(fold_partial(media_partial(q, vis, m, cache.length, scale), kv_heads));
  at::Tensor o;
  for (const Partial& p : merge_across_ranks(pg, local)) {
    const at::Tensor call = unfold_tokens(p, q.size(1), kv_heads).o;
    o = o.defined() ? o + call : call;
  }
  return o;
}

Partial fold_partial(const Partial& p, int64_t kv_heads) {
  return {fold_tokens(p.o.contiguous(), kv_heads),
          fold_tokens(p.lse.contiguous().unsqueeze(-1), kv_heads).squeeze(-1)};
}

void seal_chunked_prompt(DecodeCache& cache, int rank, int world) {
  for (size_t i = 0; i < cache.new_k.size(); ++i) {
    if (cache.new_k[i].empty()) {  // a layer without self-attention (Llama-3.2-Vision's cross)
      cache.prompt[i] = KVShard{};
      continue;
    }
    const at::Tensor k = at::cat(cache.new_k[i], 1), v = at::cat(cache.new_v[i], 1);
    const int64_t L = k.size(1), lo = L * rank / world, hi = L * (rank + 1) / world;
    // A copy of the slice: the whole prompt's K/V (on every rank until now) are freed.
    cache.prompt[i] = {k.narrow(1, lo, hi - lo).clone(), v.narrow(1, lo, hi - lo).clone(),
                       at::Tensor()};
    cache.new_k[i].clear();
    cache.new_v[i].clear();
  }
  cache.prompt_media.clear();
  cache.prompt_sees = at::Tensor();
  cache.prompt_key_reads = at::Tensor();
}

at::Tensor media_key_reads(const attention::MediaMask& mm, int64_t length) {
  const at::Tensor q = mm.q_media.narrow(1, 0, length).to(at::kCPU).to(at::kLong);  // [B, L]
  const at::Tensor kv = mm.kv_media.to(at::kCPU).to(at::kLong);                     // [B, S]
  const int64_t B = q.size(0), images = std::max<int64_t>(mm.slots, 1);
  // Keys per image and sample, with a column in front for padding (kv_media −1).
  const at::Tensor per_image = at::zeros({B, images + 1}, at::kLong)
                                   .scatter_add_(1, kv + 1, at::ones_like(kv))
                                   .narrow(1, 1, images);
  const at::Tensor seen =
      mm.rule == kernels::MediaRule::kUpTo ? per_image.cumsum(1) : per_image;  // [B, images]
  // Column 0: a position that sees no image (q_media −1).
  const at::Tensor none =
      mm.unmatched_sees_all ? per_image.sum(1, true) : at::zeros({B, 1}, at::kLong);
  return at::cat({none, seen}, 1).gather(1, q + 1).sum(0);
}

void start_prompt_cache(DecodeCache& cache, int64_t layers, int64_t B, int64_t L,
                        std::chrono::steady_clock::time_point encode_start) {
  cache = DecodeCache{};
  cache.encode_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - encode_start).count();
  const auto n = static_cast<size_t>(layers);
  cache.prompt.resize(n);
  cache.visual.resize(n);
  cache.new_k.resize(n);
  cache.new_v.resize(n);
  cache.length = L;
  cache.batch = B;
}

DecodeCache chunked_prompt_cache(int64_t layers, int64_t batch, int64_t kv_heads, int64_t head_dim,
                                 const at::TensorOptions& like) {
  DecodeCache cache;
  const auto n = static_cast<size_t>(layers);
  const at::Tensor none = at::empty({batch, 0, kv_heads, head_dim}, like);
  cache.prompt.assign(n, KVShard{none, none, at::Tensor()});
  cache.visual.resize(n);
  cache.new_k.resize(n);
  cache.new_v.resize(n);
  cache.batch = batch;
  return cache;
}

int64_t extend_length(const at::Tensor& tokens, const DecodeCache& cache) {
  LVX_CHECK(tokens.dim() == 2 && tokens.size(0) == cache.batch && tokens.size(1) >= 1,
            "extend: expected [", cache.batch, ", T >= 1] tokens, got ", tokens.sizes());
  return tokens.size(1);
}

}  // namespace lvx::models
