// OpenFlamingo's generation (models/decode.h): the prefill, one decode step, a kept prompt's
// continuation (extend) and several generations' steps at once (decode_rows). The forward and the
// model's parts are model.cpp.
#include <c10/core/GradMode.h>

#include <chrono>
#include <cmath>

#include "kernels/linear.h"
#include "models/lead_decode.h"
#include "models/openflamingo/model.h"
#include "src/common/error.h"

namespace lvx::models {

at::Tensor OpenFlamingo::prefill(const ModelInputs& in, const Parallel& par,
                                 DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const ModelOutputs out = run(in, par, &cache);
  return last_token_logits(out.logits, out.positions, in.input_ids.size(1), lm_head(), *par.pg);
}

void OpenFlamingo::prefill_media(const ModelInputs& in, const Parallel& par,
                                 DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const OpenFlamingoConfig& c = cfg_;
  check_named_inputs(in, {}, "OpenFlamingo");
  const at::Tensor& ids = in.input_ids;
  const int64_t B = ids.size(0), L = ids.size(1), T = c.p_latents;
  const at::TensorOptions options = embedding().options();
  const attention::MediaMask mm =
      attention::media_mask(kMediaMaskImmediate, host_ids(ids), c.media_token_id, T);
  LVX_CHECK(mm.slots > 0, "prefill_media: the prompt has no image");
  const attention::MediaMask mmd = media_mask_on(mm, options.device());
  const auto encode_start = std::chrono::steady_clock::now();
  const LocalMedia media = local_media(in, par, mm, options);
  // The self K/V's width: MPT's carry the ALiBi channels.
  const int64_t width =
      c.head_dim + (c.lm == "mpt" ? alibi_channels(options.dtype().toScalarType()) : 0);
  cache = chunked_prompt_cache(c.layers, B, c.kv_heads, width, options);
  // As the whole prefill leaves it (run): later tokens see their sample's last image only.
  const at::Tensor images = host_ids(ids).eq(c.media_token_id).sum(1).to(options.device());
  cache.sees_media = images.gt(0);
  const at::Tensor keys = mmd.kv_media.index_select(1, media.key_index(T).to(options.device()));
  cache.prompt_media = {{mmd.q_media.narrow(1, 0, L), keys, kMediaMaskImmediate.kernel_rule()}};
  cache.prompt_key_reads = media_key_reads(mm, L);
  const at::Tensor last_image =
      keys.ge(0) & keys.eq((images - 1).unsqueeze(1).to(keys.scalar_type()));
  for (int64_t i = 0; i < c.layers; ++i) {
    if (!c.is_cross(i)) continue;
    const auto [k, v] = cross_kv(i, media.features);
    cache.visual[static_cast<size_t>(i)] = visual_shard(k, v, last_image);
  }
  cache.encode_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - encode_start).count();
}

std::vector<CrossCall> OpenFlamingo::decode_cross_calls() const {
  std::vector<CrossCall> calls;
  for (int64_t i = 0; i < cfg_.layers; ++i)
    if (cfg_.is_cross(i))
      calls.push_back({i, cfg_.x_heads, cfg_.x_dim_head,
                       1.0 / std::sqrt(static_cast<double>(cfg_.x_dim_head))});
  return calls;
}

at::Tensor OpenFlamingo::decode_step(const at::Tensor& tokens, const Parallel& par,
                                     DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const OpenFlamingoConfig& c = cfg_;
  const int64_t B = cache.batch, hd = c.head_dim;
  LVX_CHECK(tokens.dim() == 1 && tokens.size(0) == B, "decode: expected one token per sample (", B,
            "), got ", tokens.sizes());
  at::Tensor x = at::embedding(embedding(),
                               tokens.to(embedding().device(), at::kLong).unsqueeze(1));  // [B,1,W]
  const at::ScalarType dt = x.scalar_type();
  const at::Tensor position = at::full({1}, cache.length, x.options().dtype(at::kLong));
  const double x_scale = 1.0 / std::sqrt(static_cast<double>(c.x_dim_head));
  for (int64_t i = 0; i < c.layers; ++i) {
    const size_t li = static_cast<size_t>(i);
    const KVShard& vis = cache.visual[li];
    if (c.is_cross(i) && vis.k.defined()) {
      // The sample's last image, wherever its keys are: pass-Q over the ranks (a sample without
      // images has no visible key anywhere: o = 0).
      const at::Tensor q = cross_query(i, x).squeeze(1);  // [B, x_heads, x_dim_head]
      const Partial o = visual_over_ranks(par, q, vis, x_scale);
      x = cross_output(i, x, o.o.reshape({B, 1, c.x_heads * c.x_dim_head}).to(dt));
    }
    const SelfQKV qkv = self_qkv(i, x, position);
    cache.new_k[li].push_back(qkv.k);
    cache.new_v[li].push_back(qkv.v);
    const at::Tensor q = qkv.q.squeeze(1);  // [B, H, D']
    // This rank's prompt keys merged over the ranks; the generated tokens' keys are on every
    // rank and join after.
    const Partial merged = prompt_over_ranks(*par.pg, cache, li, q, self_scale());
    const auto [nk, nv] = new_keys(cache, li);
    const Partial generated = partial_attention(q, nk, nv, {}, self_scale());
    const at::Tensor a = merge_partials({merged, generated})
                             .o.narrow(-1, 0, hd)
                             .reshape({B, 1, c.heads * hd})
                             .to(dt);
    x = post_attention(i, x, a, /*remat=*/false);
  }
  ++cache.length;
  return kernels::linear(final_norm(x).squeeze(1), lm_head()).to(at::kFloat);
}

// The new tokens of a kept prompt (models/model.h extend), as decode_step takes one: every one of
// them comes after the prompt's last `<image>` (the prefix ends there), so each sees its sample's
// last image, as a generated token does; their queries go to the cached keys as extra heads
// (fold_tokens: one call per rank and one pass-Q message per attention), causal among themselves.
at::Tensor OpenFlamingo::extend(const at::Tensor& tokens, const Parallel& par,
                                DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const OpenFlamingoConfig& c = cfg_;
  const int64_t B = cache.batch, hd = c.head_dim;
  const int64_t T = extend_length(tokens, cache);
  at::Tensor x = at::embedding(embedding(), tokens.to(embedding().device(), at::kLong));  // [B,T,W]
  const at::ScalarType dt = x.scalar_type();
  const at::Tensor positions =
      at::arange(cache.length, cache.length + T, x.options().dtype(at::kLong));
  const double x_scale = 1.0 / std::sqrt(static_cast<double>(c.x_dim_head));
  // A chunk of a prompt prefilled in chunks (prefill_media): each token sees its most recent
  // image (none before the first), where a token after the whole prompt sees the last one.
  const bool chunk = prefilling_chunks(cache, T);
  for (int64_t i = 0; i < c.layers; ++i) {
    const size_t li = static_cast<size_t>(i);
    const KVShard& vis = cache.visual[li];
    if (c.is_cross(i) && vis.k.defined()) {
      const at::Tensor q = cross_query(i, x);
      const at::Tensor o = chunk ? media_over_ranks(q, vis, cache, *par.pg, x_scale)
                                 : tokens_over_ranks(q, vis, *par.pg, x_scale).o;
      x = cross_output(i, x, o.reshape({B, T, c.x_heads * c.x_dim_head}).to(dt));
    }
    const SelfQKV qkv = self_qkv(i, x, positions);
    const int64_t before = new_key_count(cache, li);
    cache.new_k[li].push_back(qkv.k);
    cache.new_v[li].push_back(qkv.v);
    const auto [nk, nv] = new_keys(cache, li);
    const Partial generated = token_rows(causal_new_keys(qkv.q, nk, nv, before, self_scale()));
    // A chunk has no cached prompt keys (its prompt's are all new keys, on every rank): no
    // message for them.
    const Partial self =
        chunk ? generated
              : merge_partials(
                    {token_rows(tokens_over_ranks(qkv.q, cache.prompt[li], *par.pg, self_scale())),
                     generated});
    const at::Tensor a = self.o.narrow(-1, 0, hd).reshape({B, T, c.heads * hd}).to(dt);
    x = post_attention(i, x, a, /*remat=*/false);
  }
  cache.length += T;
  return kernels::linear(final_norm(x.select(1, T - 1)), lm_head()).to(at::kFloat);
}

// Several generations' next tokens at once (Model::decode_rows): the projections and MLPs of all
// rows in one product each, each row at its own position against its own cache; every row's
// partials over its cached keys in one pass-Q message per attention; a gated block runs for the
// rows with images only (as decode_step skips it for a sample without any).
at::Tensor OpenFlamingo::decode_rows(const at::Tensor& tokens, const Parallel& par,
                                     const std::vector<DecodeCache*>& caches) const {
  c10::AutoGradMode no_grad(false);
  const OpenFlamingoConfig& c = cfg_;
  const int64_t R = static_cast<int64_t>(caches.size()), hd = c.head_dim;
  const at::Tensor positions = row_positions(tokens, caches, embedding().device());  // [R, 1]
  at::Tensor x = at::embedding(embedding(),
                               tokens.to(embedding().device(), at::kLong).unsqueeze(1));  // [R,1,W]
  for (int64_t i = 0; i < c.layers; ++i) {
    const size_t li = static_cast<size_t>(i);
    if (c.is_cross(i)) x = cross_rows(i, x, par, caches);
    const SelfQKV qkv = self_qkv(i, x, positions);
    push_rows_keys(caches, li, qkv.k.squeeze(1), qkv.v.squeeze(1), std::vector<int64_t>(R, 1));
    const at::Tensor q = qkv.q.squeeze(1);  // [R, H, D']
    const at::Tensor a = rows_self_partial(q, caches, li, par, self_scale())
                             .o.narrow(-1, 0, hd)
                             .reshape({R, 1, c.heads * hd})
                             .to(x.scalar_type());
    x = post_attention(i, x, a, /*remat=*/false);
  }
  for (DecodeCache* k : caches) ++k->length;
  return kernels::linear(final_norm(x).squeeze(1), lm_head()).to(at::kFloat);
}

at::Tensor OpenFlamingo::cross_rows(int64_t layer, const at::Tensor& x, const Parallel& par,
                                    const std::vector<DecodeCache*>& caches) const {
  const size_t li = static_cast<size_t>(layer);
  std::vector<DecodeCache*> with;
  std::vector<int64_t> idx;
  for (size_t r = 0; r < caches.size(); ++r)
    if (caches[r]->visual[li].k.defined()) {
      with.push_back(caches[r]);
      idx.push_back(static_cast<int64_t>(r));
    }
  if (with.empty()) return x;  // no row has an image: the block is skipped
  const bool all = with.size() == caches.size();
  const at::Tensor index = at::tensor(idx, at::kLong).to(x.device());
  const at::Tensor xs = all ? x : x.index_select(0, index);
  const int64_t n = xs.size(0);
  const double x_scale = 1.0 / std::sqrt(static_cast<double>(cfg_.x_dim_head));
  const Partial o =
      rows_over_cache(cross_query(layer, xs).squeeze(1), with, li, true, *par.pg, x_scale);
  const at::Tensor out = cross_output(
      layer, xs, o.o.reshape({n, 1, cfg_.x_heads * cfg_.x_dim_head}).to(x.scalar_type()));
  return all ? out : x.index_copy(0, index, out);
}

}  // namespace lvx::models
