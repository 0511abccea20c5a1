// Llama-3.2-Vision's generation (models/decode.h): the prefill, one decode step, a kept prompt's
// continuation or a chunk of one (extend) and several generations' steps at once
// (decode_rows). The forward and the model's parts are model.cpp.
#include <c10/core/GradMode.h>

#include <cmath>

#include "kernels/linear.h"
#include "models/lead_decode.h"
#include "models/mllama/model.h"
#include "models/mllama/names.h"
#include "src/common/error.h"

namespace lvx::models::mllama {

namespace {

// The rows of `caches` whose layer `layer` has visual keys (rows without images skip the cross
// layer), their indices on `device`, and whether that is every row.
struct RowsWithImages {
  std::vector<DecodeCache*> caches;
  at::Tensor index;
  bool all = false;
};
RowsWithImages rows_with_images(const std::vector<DecodeCache*>& caches, size_t layer,
                                const at::Device& device) {
  RowsWithImages out;
  std::vector<int64_t> idx;
  for (size_t r = 0; r < caches.size(); ++r)
    if (caches[r]->visual[layer].k.defined()) {
      out.caches.push_back(caches[r]);
      idx.push_back(static_cast<int64_t>(r));
    }
  out.index = at::tensor(idx, at::kLong).to(device);
  out.all = idx.size() == caches.size();
  return out;
}

}  // namespace

at::Tensor Mllama::prefill(const ModelInputs& in, const Parallel& par, DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const ModelOutputs out = run(in, par, &cache);
  return last_token_logits(out.logits, out.positions, in.input_ids.size(1), lm_head(), *par.pg);
}

std::vector<CrossCall> Mllama::decode_cross_calls() const {
  const TextConfig& t = cfg_.text;
  std::vector<CrossCall> calls;
  for (int64_t i = 0; i < t.layers; ++i)
    if (t.is_cross(i))
      calls.push_back({i, t.heads, t.head_dim, 1.0 / std::sqrt(static_cast<double>(t.head_dim))});
  return calls;
}

at::Tensor Mllama::decode_step(const at::Tensor& tokens, const Parallel& par,
                               DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const TextConfig& t = cfg_.text;
  const int64_t B = cache.batch, Hq = t.heads, Hkv = t.kv_heads, D = t.head_dim;
  LVX_CHECK(tokens.dim() == 1 && tokens.size(0) == B, "decode: expected one token per sample (", B,
            "), got ", tokens.sizes());
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  at::Tensor h = at::embedding(emb, tokens.to(emb.device(), at::kLong).unsqueeze(1));  // [B, 1, H]
  const RotaryTables rope =
      llama_rotary(at::full({1}, cache.length, emb.options().dtype(at::kLong)),
                   rope_inv_freq(t, emb.options().dtype(at::kFloat)));
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // A generated token repeats the last prompt row of the mask (transformers' generate).
  const at::Tensor sees = cache.sees_media.to(h.scalar_type()).view({B, 1, 1});
  for (int64_t i = 0; i < t.layers; ++i) {
    const std::string l = layer_prefix(i);
    const size_t li = static_cast<size_t>(i);
    const at::Tensor x = rms_norm(h, param(w_, l + "input_layernorm.weight"), t.rms_eps);
    if (!t.is_cross(i)) {
      at::Tensor q = linear(x, w_, l + "self_attn.q_proj", false).view({B, 1, Hq, D});
      at::Tensor k = linear(x, w_, l + "self_attn.k_proj", false).view({B, 1, Hkv, D});
      const at::Tensor v = linear(x, w_, l + "self_attn.v_proj", false).view({B, 1, Hkv, D});
      q = apply_rotary(q, rope);
      k = apply_rotary(k, rope);
      cache.new_k[li].push_back(k);
      cache.new_v[li].push_back(v);
      const at::Tensor q1 = q.squeeze(1);
      const Partial merged = prompt_over_ranks(*par.pg, cache, li, q1, scale);
      const auto [nk, nv] = new_keys(cache, li);
      const Partial generated = partial_attention(q1, nk, nv, {}, scale);
      const at::Tensor ctx = merge_partials({merged, generated}).o;
      h = self_block(i, h, ctx.reshape({B, 1, Hq * D}).to(h.scalar_type()), false);
      continue;
    }
    const KVShard& vis = cache.visual[li];
    if (!vis.k.defined()) continue;  // no image: the layer is skipped
    at::Tensor q = linear(x, w_, l + "cross_attn.q_proj", false).view({B, 1, Hq, D});
    q = rms_norm(q, param(w_, l + "cross_attn.q_norm.weight"), t.rms_eps);
    const Partial merged = visual_over_ranks(par, q.squeeze(1), vis, scale);
    const at::Tensor ctx = merged.o.reshape({B, 1, Hq * D}).to(h.scalar_type());
    h = cross_block(i, h, ctx, sees, false);
  }
  ++cache.length;
  h = rms_norm(h, param(w_, kLm + "norm.weight"), t.rms_eps);
  return kernels::linear(h.squeeze(1), lm_head()).to(at::kFloat);
}

// The new tokens of a kept prompt (models/model.h extend), as decode_step takes one: every one of
// them comes after the prompt's last image token (the prefix ends there), so each repeats the
// prefix's last row of the cross-attention mask, as a generated token does; their queries go to
// the cached keys as extra heads (fold_tokens), causal among themselves.
at::Tensor Mllama::extend(const at::Tensor& tokens, const Parallel& par, DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const TextConfig& t = cfg_.text;
  const int64_t B = cache.batch, Hq = t.heads, Hkv = t.kv_heads, D = t.head_dim;
  const int64_t T = extend_length(tokens, cache);
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  at::Tensor h = at::embedding(emb, tokens.to(emb.device(), at::kLong));  // [B, T, H]
  const RotaryTables rope =
      llama_rotary(at::arange(cache.length, cache.length + T, emb.options().dtype(at::kLong)),
                   rope_inv_freq(t, emb.options().dtype(at::kFloat)));
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // A chunk of a prompt prefilled in chunks (prefill_media): each token sees the tiles its row of
  // the cross-attention mask gives it, where a token after the whole prompt repeats the last row.
  const bool chunk = prefilling_chunks(cache, T);
  const at::Tensor sees =
      chunk ? cache.prompt_sees.narrow(1, cache.length, T).to(h.scalar_type()).unsqueeze(-1)
            : cache.sees_media.to(h.scalar_type()).view({B, 1, 1});
  for (int64_t i = 0; i < t.layers; ++i) {
    const std::string l = layer_prefix(i);
    const size_t li = static_cast<size_t>(i);
    const at::Tensor x = rms_norm(h, param(w_, l + "input_layernorm.weight"), t.rms_eps);
    if (!t.is_cross(i)) {
      const at::Tensor q =
          apply_rotary(linear(x, w_, l + "self_attn.q_proj", false).view({B, T, Hq, D}), rope);
      const at::Tensor k =
          apply_rotary(linear(x, w_, l + "self_attn.k_proj", false).view({B, T, Hkv, D}), rope);
      const int64_t before = new_key_count(cache, li);
      cache.new_k[li].push_back(k);
      cache.new_v[li].push_back(linear(x, w_, l + "self_attn.v_proj", false).view({B, T, Hkv, D}));
      const auto [nk, nv] = new_keys(cache, li);
      const Partial generated = causal_new_keys(q, nk, nv, before, scale);
      // A chunk has no cached prompt keys (its prompt's are all new keys, on every rank): no
      // message for them.
      const at::Tensor ctx =
          chunk
              ? token_rows(generated).o
              : merge_partials({token_rows(tokens_over_ranks(q, cache.prompt[li], *par.pg, scale)),
                                token_rows(generated)})
                    .o;
      h = self_block(i, h, ctx.reshape({B, T, Hq * D}).to(h.scalar_type()), false);
      continue;
    }
    const KVShard& vis = cache.visual[li];
    if (!vis.k.defined()) continue;  // no image: the layer is skipped
    const at::Tensor q = rms_norm(linear(x, w_, l + "cross_attn.q_proj", false).view({B, T, Hq, D}),
                                  param(w_, l + "cross_attn.q_norm.weight"), t.rms_eps);
    const at::Tensor o = chunk ? media_over_ranks(q, vis, cache, *par.pg, scale)
                               : tokens_over_ranks(q, vis, *par.pg, scale).o;
    const at::Tensor ctx = o.reshape({B, T, Hq * D}).to(h.scalar_type());
    h = cross_block(i, h, ctx, sees, false);
  }
  cache.length += T;
  h = rms_norm(h.select(1, T - 1), param(w_, kLm + "norm.weight"), t.rms_eps);
  return kernels::linear(h, lm_head()).to(at::kFloat);
}

// Several generations' next tokens at once (Model::decode_rows): the projections and MLPs of all
// rows in one product each, each row at its own position against its own cache; every row's
// partials over its cached keys in one pass-Q message per layer; a cross layer runs for the rows
// with images only (as decode_step skips it for a sample without any).
at::Tensor Mllama::decode_rows(const at::Tensor& tokens, const Parallel& par,
                               const std::vector<DecodeCache*>& caches) const {
  c10::AutoGradMode no_grad(false);
  const TextConfig& t = cfg_.text;
  const int64_t R = static_cast<int64_t>(caches.size()), Hq = t.heads, Hkv = t.kv_heads,
                D = t.head_dim;
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  const at::Tensor positions = row_positions(tokens, caches, emb.device());            // [R, 1]
  at::Tensor h = at::embedding(emb, tokens.to(emb.device(), at::kLong).unsqueeze(1));  // [R, 1, H]
  const RotaryTables rope =
      llama_rotary(positions, rope_inv_freq(t, emb.options().dtype(at::kFloat)));
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  for (int64_t i = 0; i < t.layers; ++i) {
    const std::string l = layer_prefix(i);
    const size_t li = static_cast<size_t>(i);
    const at::Tensor x = rms_norm(h, param(w_, l + "input_layernorm.weight"), t.rms_eps);
    if (!t.is_cross(i)) {
      const at::Tensor q =
          apply_rotary(linear(x, w_, l + "self_attn.q_proj", false).view({R, 1, Hq, D}), rope);
      const at::Tensor k =
          apply_rotary(linear(x, w_, l + "self_attn.k_proj", false).view({R, 1, Hkv, D}), rope);
      const at::Tensor v = linear(x, w_, l + "self_attn.v_proj", false).view({R, 1, Hkv, D});
      push_rows_keys(caches, li, k.squeeze(1), v.squeeze(1), std::vector<int64_t>(R, 1));
      const at::Tensor q1 = q.squeeze(1);
      const at::Tensor ctx = rows_self_partial(q1, caches, li, par, scale).o;
      h = self_block(i, h, ctx.reshape({R, 1, Hq * D}).to(h.scalar_type()), false);
      continue;
    }
    const RowsWithImages with = rows_with_images(caches, li, h.device());
    if (with.caches.empty()) continue;  // no row has an image: the layer is skipped
    const at::Tensor hs = with.all ? h : h.index_select(0, with.index);
    const at::Tensor xs = with.all ? x : x.index_select(0, with.index);
    const int64_t n = hs.size(0);
    const at::Tensor q = rms_norm(linear(xs, w_, l + "cross_attn.q_proj", false).view({n, Hq, D}),
                                  param(w_, l + "cross_attn.q_norm.weight"), t.rms_eps);
    const at::Tensor ctx = rows_over_cache(q, with.caches, li, true, *par.pg, scale)
                               .o.reshape({n, 1, Hq * D})
                               .to(h.scalar_type());
    std::vector<at::Tensor> sees;
    for (DecodeCache* k : with.caches) sees.push_back(k->sees_media);
    const at::Tensor out =
        cross_block(i, hs, ctx, at::cat(sees).to(h.scalar_type()).view({n, 1, 1}), false);
    h = with.all ? out : h.index_copy(0, with.index, out);
  }
  for (DecodeCache* k : caches) ++k->length;
  h = rms_norm(h, param(w_, kLm + "norm.weight"), t.rms_eps);
  return kernels::linear(h.squeeze(1), lm_head()).to(at::kFloat);
}

}  // namespace lvx::models::mllama
