// mPLUG-Owl3's generation (models/decode.h): the prefill, one decode step, several rows' steps
// at once (continuous batching), and a kept prompt's continuation (extend, extend_rows). The
// forward and the model's parts are model.cpp.
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/linear.h"
#include "models/layers.h"
#include "models/lead_decode.h"
#include "models/mplug_owl3/model.h"
#include "models/mplug_owl3/names.h"
#include "models/side_by_side.h"
#include "src/common/error.h"

namespace lvx::models {

using mplug_owl3_names::kLm;
using mplug_owl3_names::layer_prefix;

at::Tensor MplugOwl3::prefill(const ModelInputs& in, const Parallel& par,
                              DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const ModelOutputs out = run(in, par, &cache);
  return last_token_logits(out.logits, out.positions, in.input_ids.size(1), lm_head(), *par.pg);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> MplugOwl3::decode_qkv(
    int64_t i, const at::Tensor& h, const RotaryTables& rope) const {
  const MplugOwl3Config& c = cfg_;
  const std::string l = layer_prefix(i);
  const int64_t B = h.size(0), L = h.size(1);
  const at::Tensor x = rms_norm(h, param(w_, l + "input_layernorm.weight"), c.rms_eps);
  return {
      apply_rotary(linear(x, w_, l + "self_attn.q_proj", true).view({B, L, c.heads, c.head_dim}),
                   rope),
      apply_rotary(linear(x, w_, l + "self_attn.k_proj", true).view({B, L, c.kv_heads, c.head_dim}),
                   rope),
      linear(x, w_, l + "self_attn.v_proj", true).view({B, L, c.kv_heads, c.head_dim})};
}

at::Tensor MplugOwl3::decode_step(const at::Tensor& tokens, const Parallel& par,
                                  DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const MplugOwl3Config& c = cfg_;
  const int64_t B = cache.batch, hq = c.heads, d = c.head_dim;
  LVX_CHECK(tokens.dim() == 1 && tokens.size(0) == B, "decode: expected one token per sample (", B,
            "), got ", tokens.sizes());
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  at::Tensor h = at::embedding(emb, tokens.to(emb.device(), at::kLong).unsqueeze(1));  // [B, 1, H]
  const RotaryTables rope = rotary_tables(
      at::full({1}, cache.length, emb.options().dtype(at::kLong)), c.head_dim, c.rope_theta);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t i = 0; i < c.layers; ++i) {
    const size_t li = static_cast<size_t>(i);
    const auto [q, k, v] = decode_qkv(i, h, rope);
    cache.new_k[li].push_back(k);
    cache.new_v[li].push_back(v);
    const at::Tensor q1 = q.squeeze(1);  // [B, Hq, D]
    const KVShard& vis = cache.visual[li];
    const bool cross = c.is_hyper(i) && vis.k.defined();
    const std::vector<Partial> merged = over_ranks(q1, cache, li, cross, par);
    const auto [nk, nv] = new_keys(cache, li);
    const Partial generated = partial_attention(q1, nk, nv, {}, scale);
    const Partial self = merge_partials({merged[0], generated});
    const at::Tensor ctx = decode_mix(i, self, cross ? &merged[1] : nullptr, cache.sees_media);
    h = post_attention(i, h, ctx.reshape({B, 1, hq * d}).to(h.scalar_type()), /*remat=*/false);
  }
  ++cache.length;
  h = rms_norm(h, param(w_, kLm + "norm.weight"), c.rms_eps);
  return kernels::linear(h.squeeze(1), lm_head()).to(at::kFloat);
}

std::vector<Partial> MplugOwl3::over_ranks(const at::Tensor& q, const DecodeCache& cache, size_t li,
                                           bool cross, const Parallel& par) const {
  const double scale = 1.0 / std::sqrt(static_cast<double>(cfg_.head_dim));
  const KVShard& vis = cache.visual[li];
  if (cache.prompt_whole) {  // rank 0 under lead decoding: only the visual partial travels
    std::vector<Partial> merged{prompt_over_ranks(*par.pg, cache, li, q, scale)};
    if (cross) merged.push_back(visual_over_ranks(par, q, vis, scale));
    return merged;
  }
  // This rank's prompt keys (and visual keys), merged over the ranks in one message; the
  // generated tokens' keys are on every rank and join after.
  const KVShard& p = cache.prompt[li];
  std::vector<Partial> local{partial_attention(q, p.k, p.v, p.visible, scale)};
  if (cross) local.push_back(partial_attention(q, vis.k, vis.v, vis.visible, scale));
  return merge_across_ranks(*par.pg, local);
}

std::vector<CrossCall> MplugOwl3::decode_cross_calls() const {
  std::vector<CrossCall> calls;
  for (int64_t i = 0; i < cfg_.layers; ++i)
    if (cfg_.is_hyper(i))
      calls.push_back(
          {i, cfg_.heads, cfg_.head_dim, 1.0 / std::sqrt(static_cast<double>(cfg_.head_dim))});
  return calls;
}

at::Tensor MplugOwl3::decode_mix(int64_t i, const Partial& self, const Partial* visual,
                                 const at::Tensor& sees_media) const {
  const int64_t B = self.o.size(0), hd = cfg_.heads * cfg_.head_dim;
  if (visual == nullptr) return self.o.reshape({B, hd});
  if (cfg_.variant == "240728") {
    const at::Tensor g = at::sigmoid(param(w_, layer_prefix(i) + "self_attn.gate")).to(at::kFloat);
    const at::Tensor xo = visual->o.reshape({B, hd}), so = self.o.reshape({B, hd});
    return at::where(sees_media.unsqueeze(1), so * (1 - g) + xo * g, so);
  }
  return merge_partials({*visual, self}).o.reshape({B, hd});  // one softmax over both
}

at::Tensor MplugOwl3::decode_rows(const at::Tensor& tokens, const Parallel& par,
                                  const std::vector<DecodeCache*>& caches) const {
  row_positions(tokens, caches, tokens.device());  // the arguments' checks
  if (caches.size() == 1) return decode_step(tokens, par, *caches[0]);
  const std::vector<at::Tensor> one_each = tokens.to(at::kLong).split(1);
  return extend_rows(one_each, par, caches);
}

at::Tensor MplugOwl3::extend(const at::Tensor& tokens, const Parallel& par,
                             DecodeCache& cache) const {
  c10::AutoGradMode no_grad(false);
  const MplugOwl3Config& c = cfg_;
  const int64_t B = cache.batch, hq = c.heads, hkv = c.kv_heads, d = c.head_dim;
  const int64_t T = extend_length(tokens, cache);
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  at::Tensor h = at::embedding(emb, tokens.to(emb.device(), at::kLong));  // [B, T, H]
  const RotaryTables rope =
      rotary_tables(at::arange(cache.length, cache.length + T, emb.options().dtype(at::kLong)),
                    c.head_dim, c.rope_theta);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // A chunk of a prompt prefilled in chunks (prefill_media): each token sees the images before
  // it (q_media), where a token after the whole prompt sees all of them.
  const bool chunk = prefilling_chunks(cache, T);
  // The T queries of a row as extra query heads (fold_tokens, models/decode.h): the cached keys
  // take all of them in one call per rank and one pass-Q message per layer.
  for (int64_t i = 0; i < c.layers; ++i) {
    const size_t li = static_cast<size_t>(i);
    const auto [q, k, v] = decode_qkv(i, h, rope);
    const int64_t before = new_key_count(cache, li);
    cache.new_k[li].push_back(k);
    cache.new_v[li].push_back(v);
    const at::Tensor qf = fold_tokens(q, hkv);
    // A chunk has no cached prompt keys (all of its prompt's are new keys, on every rank): only
    // its visual partial travels, and a layer without one sends nothing.
    std::vector<Partial> local;
    if (!chunk)
      local.push_back(partial_attention(qf, cache.prompt[li].k, cache.prompt[li].v,
                                        cache.prompt[li].visible, scale));
    const KVShard& vis = cache.visual[li];
    const bool cross = c.is_hyper(i) && vis.k.defined();
    if (cross)
      local.push_back(
          chunk
              ? fold_partial(media_partial(q, vis, cache.prompt_media[0], cache.length, scale), hkv)
              : partial_attention(qf, vis.k, vis.v, vis.visible, scale));
    std::vector<Partial> merged = local.empty() ? local : merge_across_ranks(*par.pg, local);
    for (Partial& p : merged) p = unfold_tokens(p, T, hkv);
    // The new keys up to each token's own (causal), on every rank: one masked product for the
    // T tokens; then every token's merge and mix at once, the tokens as rows ([B·T, ...]).
    const auto [nk, nv] = new_keys(cache, li);
    const Partial generated = token_rows(causal_new_keys(q, nk, nv, before, scale));
    const Partial self = chunk ? generated : merge_partials({token_rows(merged[0]), generated});
    const Partial visual = cross ? token_rows(merged.back()) : Partial{};
    const at::Tensor sees = chunk ? cache.prompt_sees.narrow(1, cache.length, T).reshape({B * T})
                                  : cache.sees_media.repeat_interleave(T);
    const at::Tensor ctx = decode_mix(i, self, cross ? &visual : nullptr, sees)
                               .view({B, T, hq * d})
                               .to(h.scalar_type());
    h = post_attention(i, h, ctx, /*remat=*/false);
  }
  cache.length += T;
  h = rms_norm(h.select(1, T - 1), param(w_, kLm + "norm.weight"), c.rms_eps);
  return kernels::linear(h, lm_head()).to(at::kFloat);
}

// Several rows' tokens in one forward: a decode step's one token each, a new question's tail,
// or both in one step (lvx serve: the running rows' next tokens beside the joining rows'
// questions). The projections and MLPs of all tokens in one product each; each row's cached
// prompt and visual keys shared by the rows holding the same tensors (rows_cached_partial), every
// row's partials in one pass-Q message per layer; the rows' own new keys in one masked product
// (rows_new_keys); the mix in one call unless rows with and without images meet in a batch.
at::Tensor MplugOwl3::extend_rows(const std::vector<at::Tensor>& tokens, const Parallel& par,
                                  const std::vector<DecodeCache*>& caches) const {
  c10::AutoGradMode no_grad(false);
  const MplugOwl3Config& c = cfg_;
  const size_t R = caches.size();
  const int64_t hq = c.heads, d = c.head_dim;
  LVX_CHECK(tokens.size() == R, "extend_rows: ", tokens.size(), " rows of tokens for ", R,
            " caches");
  std::vector<int64_t> lengths, positions, before;
  for (size_t r = 0; r < R; ++r) {
    LVX_CHECK(caches[r]->batch == 1 && tokens[r].dim() == 1 && tokens[r].size(0) >= 1,
              "extend_rows: one sample and at least one token per row");
    lengths.push_back(tokens[r].size(0));
    before.push_back(new_key_count(*caches[r], 0));
    for (int64_t t = 0; t < lengths.back(); ++t) positions.push_back(caches[r]->length + t);
  }
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  const RowsLayout layout = rows_layout(lengths, before, emb.device());
  const int64_t N = layout.tokens;
  at::Tensor h = at::embedding(emb, at::cat(tokens).to(emb.device(), at::kLong)).unsqueeze(0);
  const RotaryTables rope = rotary_tables(
      at::tensor(positions, at::kLong).to(emb.device()).unsqueeze(0), c.head_dim, c.rope_theta);
  std::vector<at::Tensor> sees;
  for (size_t r = 0; r < R; ++r) sees.push_back(caches[r]->sees_media.expand({lengths[r]}));
  const at::Tensor sees_media = at::cat(sees);  // [N]
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // One row steps alone with its cache's pieces (rows_new_keys): nothing to overlap.
  const bool overlap = par.side_by_side && R > 1;
  for (int64_t i = 0; i < c.layers; ++i) {
    const size_t li = static_cast<size_t>(i);
    const auto [q, k, v] = decode_qkv(i, h, rope);
    push_rows_keys(caches, li, k[0], v[0], lengths);
    std::vector<bool> cross(R);
    size_t crossing = 0;
    for (size_t r = 0; r < R; ++r) {
      cross[r] = c.is_hyper(i) && caches[r]->visual[li].k.defined();
      crossing += cross[r] ? 1 : 0;
    }
    const at::Tensor qn = q.squeeze(0);  // [N, Hq, D]
    // This rank's partials, side by side (models/side_by_side.h): the visual keys' beside the
    // prompt's and the rows' own keys'; without images the prompt's beside the own keys'.
    // On one rank the prompt's keys may join the own keys' product (prompt_front): no text call.
    const PromptFront front = prompt_front(caches, li, par);
    Partial text, image, own;
    auto text_part = [&] {
      if (!front) text = rows_cached_partial(qn, lengths, caches, li, false, scale);
    };
    auto own_part = [&] { own = rows_new_keys(qn, caches, li, layout, scale, front); };
    if (crossing > 0)
      side_by_side(
          overlap, emb.device(),
          [&] { image = rows_cached_partial(qn, lengths, caches, li, true, scale); },
          [&] {
            text_part();
            own_part();
          });
    else
      side_by_side(overlap, emb.device(), text_part, own_part);
    // Every row's text partial as one [N, ...] partial, the visual one of the rows with images
    // as another: one pass-Q message when every row has images, two otherwise.
    std::vector<Partial> merged{text};
    if (crossing > 0) {
      if (crossing == R) {
        merged = merge_across_ranks(*par.pg, {merged[0], image});
      } else {
        merged = merge_across_ranks(*par.pg, merged);
        merged.push_back(merge_across_ranks(*par.pg, {image})[0]);
      }
    } else {
      merged = merge_across_ranks(*par.pg, merged);
    }
    const Partial self = front ? own : merge_partials({merged[0], own});
    const at::Tensor ctx =
        crossing == R || crossing == 0
            ? decode_mix(i, self, crossing == 0 ? nullptr : &merged[1], sees_media)
            : mix_rows(i, self, merged[1], cross, lengths, caches);
    h = post_attention(i, h, ctx.reshape({1, N, hq * d}).to(h.scalar_type()), /*remat=*/false);
  }
  std::vector<int64_t> last;
  for (size_t r = 0, at = 0; r < R; ++r) {
    caches[r]->length += lengths[r];
    at += static_cast<size_t>(lengths[r]);
    last.push_back(static_cast<int64_t>(at) - 1);
  }
  h = h.squeeze(0).index_select(0, at::tensor(last, at::kLong).to(h.device()));  // [R, H]
  h = rms_norm(h, param(w_, kLm + "norm.weight"), c.rms_eps);
  return kernels::linear(h, lm_head()).to(at::kFloat);
}

// Rows with and without images in one batch: each row's tokens mixed on their own (the
// images' partial holds the rows with images only, in row order).
at::Tensor MplugOwl3::mix_rows(int64_t i, const Partial& self, const Partial& image,
                               const std::vector<bool>& cross, const std::vector<int64_t>& lengths,
                               const std::vector<DecodeCache*>& caches) const {
  std::vector<at::Tensor> ctx;
  for (size_t r = 0, at = 0, at_image = 0; r < caches.size(); ++r) {
    const int64_t t = lengths[r];
    auto rows_of = [t](const Partial& p, size_t from) {
      return Partial{p.o.narrow(0, static_cast<int64_t>(from), t),
                     p.lse.narrow(0, static_cast<int64_t>(from), t)};
    };
    const Partial visual = cross[r] ? rows_of(image, at_image) : Partial{};
    ctx.push_back(decode_mix(i, rows_of(self, at), cross[r] ? &visual : nullptr,
                             caches[r]->sees_media.expand({t})));
    at += static_cast<size_t>(t);
    if (cross[r]) at_image += static_cast<size_t>(t);
  }
  return at::cat(ctx, 0);
}

}  // namespace lvx::models
