// mPLUG-Owl3's generation (models/decode.h): the prefill, one decode step, several rows' steps
// at once (continuous batching), and a kept prompt's continuation (extend, extend_rows). The
// forward and the model's parts are model.cpp.
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "models/layers.h"
#include "models/mplug_owl3/model.h"
#include "models/mplug_owl3/names.h"
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
  return {apply_rotary(linear(x, w_, l + "self_attn.q_proj", true).view({B, L, c.heads, c.head_dim}),
                       rope),
          apply_rotary(
              linear(x, w_, l + "self_attn.k_proj", true).view({B, L, c.kv_heads, c.head_dim}),
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
    // This rank's prompt keys (and visual keys), merged over the ranks in one message; the
    // generated tokens' keys are on every rank and join after.
    std::vector<Partial> local{partial_attention(q1, cache.prompt[li].k, cache.prompt[li].v,
                                                 cache.prompt[li].visible, scale)};
    const KVShard& vis = cache.visual[li];
    const bool cross = c.is_hyper(i) && vis.k.defined();
    if (cross) local.push_back(partial_attention(q1, vis.k, vis.v, vis.visible, scale));
    const std::vector<Partial> merged = merge_across_ranks(*par.pg, local);
    const Partial generated =
        partial_attention(q1, at::cat(cache.new_k[li], 1), at::cat(cache.new_v[li], 1), {}, scale);
    const Partial self = merge_partials({merged[0], generated});
    const at::Tensor ctx = decode_mix(i, self, cross ? &merged[1] : nullptr, cache.sees_media);
    h = post_attention(i, h, ctx.reshape({B, 1, hq * d}).to(h.scalar_type()), /*remat=*/false);
  }
  ++cache.length;
  h = rms_norm(h, param(w_, kLm + "norm.weight"), c.rms_eps);
  return at::linear(h.squeeze(1), lm_head()).to(at::kFloat);
}

at::Tensor MplugOwl3::decode_mix(int64_t i, const Partial& self, const Partial* visual,
                                 const at::Tensor& sees_media) const {
  const int64_t B = self.o.size(0), hd = cfg_.heads * cfg_.head_dim;
  if (visual == nullptr) return self.o.reshape({B, hd});
  if (cfg_.variant == "240728") {
    const at::Tensor g =
        at::sigmoid(param(w_, layer_prefix(i) + "self_attn.gate")).to(at::kFloat);
    const at::Tensor xo = visual->o.reshape({B, hd}), so = self.o.reshape({B, hd});
    return at::where(sees_media.unsqueeze(1), so * (1 - g) + xo * g, so);
  }
  return merge_partials({*visual, self}).o.reshape({B, hd});  // one softmax over both
}

at::Tensor MplugOwl3::decode_rows(const at::Tensor& tokens, const Parallel& par,
                                  const std::vector<DecodeCache*>& caches) const {
  c10::AutoGradMode no_grad(false);
  const MplugOwl3Config& c = cfg_;
  const int64_t R = static_cast<int64_t>(caches.size()), hq = c.heads, d = c.head_dim;
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  const at::Tensor positions = row_positions(tokens, caches, emb.device());  // [R, 1]
  at::Tensor h = at::embedding(emb, tokens.to(emb.device(), at::kLong).unsqueeze(1));  // [R, 1, H]
  // Each row at its own position: tables [R, 1, rot].
  const RotaryTables rope = rotary_tables(positions, c.head_dim, c.rope_theta);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t i = 0; i < c.layers; ++i) {
    const size_t li = static_cast<size_t>(i);
    // The projections and the MLP of every row in one product each (the weights read once).
    const auto [q, k, v] = decode_qkv(i, h, rope);
    // Each row's cached keys (its prompt prefix, its video's visual keys): rows that hold the
    // same tensors (questions about one cached video) in one call; every row's partials in one
    // pass-Q message, row by row.
    std::vector<bool> cross(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) {
      DecodeCache& kc = *caches[static_cast<size_t>(r)];
      kc.new_k[li].push_back(k.narrow(0, r, 1));
      kc.new_v[li].push_back(v.narrow(0, r, 1));
      cross[static_cast<size_t>(r)] = c.is_hyper(i) && kc.visual[li].k.defined();
    }
    const at::Tensor q1 = q.squeeze(1);  // [R, Hq, D]
    std::vector<at::Tensor> per_row;
    for (int64_t r = 0; r < R; ++r) per_row.push_back(q1.narrow(0, r, 1));
    const std::vector<Partial> text = shared_partials(per_row, caches, li, /*visual=*/false, scale);
    const std::vector<Partial> image = shared_partials(per_row, caches, li, /*visual=*/true, scale);
    std::vector<Partial> local;
    for (size_t r = 0; r < static_cast<size_t>(R); ++r) {
      local.push_back(text[r]);
      if (cross[r]) local.push_back(image[r]);
    }
    const std::vector<Partial> merged = merge_across_ranks(*par.pg, local);
    // The rows' merged partials stacked [R, ...]; the generated keys of every row (its question
    // and answer so far, on every rank) in one call, each row's padded to the longest.
    std::vector<Partial> text_r, image_r;
    for (size_t r = 0, at = 0; r < static_cast<size_t>(R); ++r) {
      text_r.push_back(merged[at]);
      if (cross[r]) image_r.push_back(merged[at + 1]);
      at += cross[r] ? 2 : 1;
    }
    const Partial self = merge_partials({stack_partials(text_r), generated_partial(q1, caches, li,
                                                                                   scale)});
    at::Tensor ctx;
    if (image_r.size() == static_cast<size_t>(R) || image_r.empty()) {
      std::vector<at::Tensor> sees;
      for (DecodeCache* kc : caches) sees.push_back(kc->sees_media);
      const Partial image = image_r.empty() ? Partial{} : stack_partials(image_r);
      ctx = decode_mix(i, self, image_r.empty() ? nullptr : &image, at::cat(sees));
    } else {  // rows with and without images: mixed row by row
      std::vector<at::Tensor> rows;
      for (size_t r = 0, k = 0; r < static_cast<size_t>(R); ++r) {
        const auto rr = static_cast<int64_t>(r);
        const Partial own{self.o.narrow(0, rr, 1), self.lse.narrow(0, rr, 1)};
        rows.push_back(decode_mix(i, own, cross[r] ? &image_r[k] : nullptr,
                                  caches[r]->sees_media));
        k += cross[r] ? 1 : 0;
      }
      ctx = at::cat(rows, 0);
    }
    h = post_attention(i, h, ctx.reshape({R, 1, hq * d}).to(h.scalar_type()), /*remat=*/false);
  }
  for (DecodeCache* k : caches) ++k->length;
  h = rms_norm(h, param(w_, kLm + "norm.weight"), c.rms_eps);
  return at::linear(h.squeeze(1), lm_head()).to(at::kFloat);
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
          chunk ? fold_partial(media_partial(q, vis, cache.prompt_media[0], cache.length, scale),
                               hkv)
                : partial_attention(qf, vis.k, vis.v, vis.visible, scale));
    std::vector<Partial> merged = local.empty() ? local : merge_across_ranks(*par.pg, local);
    for (Partial& p : merged) p = unfold_tokens(p, T, hkv);
    // The new keys up to each token's own (causal), on every rank: one masked product for the
    // T tokens; then every token's merge and mix at once, the tokens as rows ([B·T, ...]).
    const Partial generated = token_rows(causal_new_keys(q, at::cat(cache.new_k[li], 1),
                                                         at::cat(cache.new_v[li], 1), before,
                                                         scale));
    const Partial self = chunk ? generated : merge_partials({token_rows(merged[0]), generated});
    const Partial visual = cross ? token_rows(merged.back()) : Partial{};
    const at::Tensor sees =
        chunk ? cache.prompt_sees.narrow(1, cache.length, T).reshape({B * T})
              : cache.sees_media.repeat_interleave(T);
    const at::Tensor ctx = decode_mix(i, self, cross ? &visual : nullptr, sees)
                               .view({B, T, hq * d})
                               .to(h.scalar_type());
    h = post_attention(i, h, ctx, /*remat=*/false);
  }
  cache.length += T;
  h = rms_norm(h.select(1, T - 1), param(w_, kLm + "norm.weight"), c.rms_eps);
  return at::linear(h, lm_head()).to(at::kFloat);
}

at::Tensor MplugOwl3::extend_rows(const std::vector<at::Tensor>& tokens, const Parallel& par,
                                  const std::vector<DecodeCache*>& caches) const {
  c10::AutoGradMode no_grad(false);
  const MplugOwl3Config& c = cfg_;
  const size_t R = caches.size();
  const int64_t hq = c.heads, d = c.head_dim;
  LVX_CHECK(tokens.size() == R, "extend_rows: ", tokens.size(), " rows of tokens for ", R,
            " caches");
  // Every row's tokens side by side as one sequence [1, N, H], each at its own positions.
  std::vector<int64_t> lengths, positions;
  for (size_t r = 0; r < R; ++r) {
    LVX_CHECK(caches[r]->batch == 1 && tokens[r].dim() == 1 && tokens[r].size(0) >= 1,
              "extend_rows: one sample and at least one token per row");
    lengths.push_back(tokens[r].size(0));
    for (int64_t t = 0; t < lengths.back(); ++t) positions.push_back(caches[r]->length + t);
  }
  const int64_t N = static_cast<int64_t>(positions.size());
  // Each row's tokens already past its prompt prefix (its new keys, the same count every layer).
  std::vector<int64_t> before;
  for (const DecodeCache* kc : caches) before.push_back(new_key_count(*kc, 0));
  const at::Tensor& emb = param(w_, kLm + "embed_tokens.weight");
  at::Tensor h = at::embedding(emb, at::cat(tokens).to(emb.device(), at::kLong)).unsqueeze(0);
  const RotaryTables rope = rotary_tables(
      at::tensor(positions, at::kLong).to(emb.device()).unsqueeze(0), c.head_dim, c.rope_theta);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int64_t i = 0; i < c.layers; ++i) {
    const size_t li = static_cast<size_t>(i);
    const auto [q, k, v] = decode_qkv(i, h, rope);
    std::vector<at::Tensor> q_r;
    std::vector<bool> cross(R);
    for (size_t r = 0, at = 0; r < R; ++r) {
      DecodeCache& kc = *caches[r];
      const int64_t t = lengths[r], a = static_cast<int64_t>(at);
      kc.new_k[li].push_back(k.narrow(1, a, t));
      kc.new_v[li].push_back(v.narrow(1, a, t));
      q_r.push_back(q.narrow(1, a, t).squeeze(0));  // [T_r, Hq, D]
      cross[r] = c.is_hyper(i) && kc.visual[li].k.defined();
      at += static_cast<size_t>(t);
    }
    // Every row's text partials as one [N, ...] partial, the visual ones of the rows with images
    // as another: pass-Q merges partials of one shape, so the rows (of different lengths) go
    // side by side; one message when every row has images, two otherwise.
    const std::vector<Partial> text = shared_partials(q_r, caches, li, false, scale);
    const std::vector<Partial> image = shared_partials(q_r, caches, li, true, scale);
    std::vector<Partial> with_images;
    for (size_t r = 0; r < R; ++r)
      if (cross[r]) with_images.push_back(image[r]);
    std::vector<Partial> merged{stack_partials(text)};
    if (with_images.size() == R) {
      merged = merge_across_ranks(*par.pg, {merged[0], stack_partials(with_images)});
    } else {
      merged = merge_across_ranks(*par.pg, merged);
      if (!with_images.empty())
        merged.push_back(merge_across_ranks(*par.pg, {stack_partials(with_images)})[0]);
    }
    std::vector<at::Tensor> ctx;
    for (size_t r = 0, at = 0, at_image = 0; r < R; ++r) {
      DecodeCache& kc = *caches[r];
      const int64_t t = lengths[r];
      const Partial generated =
          causal_new_keys(q_r[r].unsqueeze(0), at::cat(kc.new_k[li], 1), at::cat(kc.new_v[li], 1),
                          before[r], scale);
      auto rows_of = [t](const Partial& p, size_t from) {
        return Partial{p.o.narrow(0, static_cast<int64_t>(from), t),
                       p.lse.narrow(0, static_cast<int64_t>(from), t)};
      };
      const Partial self = merge_partials(
          {rows_of(merged[0], at), {generated.o.squeeze(0), generated.lse.squeeze(0)}});
      const Partial visual = cross[r] ? rows_of(merged[1], at_image) : Partial{};
      ctx.push_back(decode_mix(i, self, cross[r] ? &visual : nullptr,
                               kc.sees_media.expand({t})));
      at += static_cast<size_t>(t);
      if (cross[r]) at_image += static_cast<size_t>(t);
    }
    h = post_attention(i, h, at::cat(ctx, 0).view({1, N, hq * d}).to(h.scalar_type()),
                       /*remat=*/false);
  }
  std::vector<int64_t> last;
  for (size_t r = 0, at = 0; r < R; ++r) {
    caches[r]->length += lengths[r];
    at += static_cast<size_t>(lengths[r]);
    last.push_back(static_cast<int64_t>(at) - 1);
  }
  h = h.squeeze(0).index_select(0, at::tensor(last, at::kLong).to(h.device()));  // [R, H]
  h = rms_norm(h, param(w_, kLm + "norm.weight"), c.rms_eps);
  return at::linear(h, lm_head()).to(at::kFloat);
}

}  // namespace lvx::models
