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

std::vector<Partial> merge_across_ranks(dist::ProcessGroup& pg, const std::vector<Partial>& local) {
  const int n = pg.world_size();
  if (n == 1) return local;
  // One message: [A, B, Hq, D + 1] (o, then lse as the last channel).
  std::vector<at::Tensor> packed;
  for (const Partial& p : local) packed.push_back(at::cat({p.o, p.lse.unsqueeze(-1)}, -1));
  const at::Tensor mine = at::stack(packed).unsqueeze(0).contiguous();  // [1, A, B, Hq, D+1]
  const at::Tensor all = pg.all_gather(mine);                           // [n, A, B, Hq, D+1]
  const int64_t D = local[0].o.size(-1);
  std::vector<Partial> merged;
  for (size_t a = 0; a < local.size(); ++a) {
    std::vector<Partial> parts;
    for (int r = 0; r < n; ++r) {
      const at::Tensor x = all[r][static_cast<int64_t>(a)];
      parts.push_back({x.narrow(-1, 0, D), x.select(-1, D)});
    }
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
  const int64_t B = q.size(0), T = q.size(1), hq = q.size(2), D = q.size(3);
  const int64_t S = nk.size(1), hkv = nk.size(2), g = hq / hkv, Dv = nv.size(3);
  const auto acc = kernels::accumulation_dtype(q.scalar_type());
  const at::Tensor qq = q.to(acc).view({B, T, hkv, g, D}).permute({0, 2, 3, 1, 4});  // B,Hkv,g,T,D
  const at::Tensor kk = nk.to(acc).permute({0, 2, 3, 1}).unsqueeze(2);  // [B, Hkv, 1, D, S]
  const at::Tensor vv = nv.to(acc).permute({0, 2, 1, 3}).unsqueeze(2);  // [B, Hkv, 1, S, Dv]
  at::Tensor sc = at::matmul(qq, kk).mul_(scale);                       // [B, Hkv, g, T, S]
  const at::Tensor hidden =  // key s is after token t: s > before + t
      at::arange(S, q.options().dtype(at::kLong)).unsqueeze(0) >
      (at::arange(T, q.options().dtype(at::kLong)) + before).unsqueeze(1);
  sc.masked_fill_(hidden, -std::numeric_limits<double>::infinity());
  const at::Tensor lse = at::logsumexp(sc, -1);                          // [B, Hkv, g, T]
  const at::Tensor o = at::matmul(at::exp(sc - lse.unsqueeze(-1)), vv);  // [B, Hkv, g, T, Dv]
  return {o.permute({0, 3, 1, 2, 4}).reshape({B, T, hq, Dv}),
          lse.permute({0, 3, 1, 2}).reshape({B, T, hq})};
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

// ---- several generations at once (continuous batching: Model::decode_rows / extend_rows) ----

// Row r's queries q[r] ([T_r, Hq, D]) over its cached prompt keys (visual: its visual keys;
// none where it has none): the rows that hold the same key tensors (questions about one cached
// video) in one shared_partial_attention call, their queries side by side. Row r's partial is
// [T_r, Hq, D] / [T_r, Hq].
Partial tokens_over_ranks(const at::Tensor& q, const KVShard& kv, dist::ProcessGroup& pg,
                          double scale) {
  const int64_t kv_heads = kv.k.size(2);
  const Partial local = partial_attention(fold_tokens(q, kv_heads), kv.k, kv.v, kv.visible, scale);
  return unfold_tokens(merge_across_ranks(pg, {local})[0], q.size(1), kv_heads);
}

int64_t new_key_count(const DecodeCache& cache, size_t layer) {
  int64_t n = 0;
  for (const at::Tensor& k : cache.new_k[layer]) n += k.size(1);
  return n;
}

std::pair<at::Tensor, at::Tensor> new_keys(DecodeCache& cache, size_t layer) {
  auto one = [](std::vector<at::Tensor>& pieces) {
    if (pieces.size() > 1) pieces = {at::cat(pieces, 1)};
    return pieces.front();
  };
  return {one(cache.new_k[layer]), one(cache.new_v[layer])};
}

at::Tensor row_positions(const at::Tensor& tokens, const std::vector<DecodeCache*>& caches,
                         const at::Device& device) {
  const auto R = static_cast<int64_t>(caches.size());
  LVX_CHECK(tokens.dim() == 1 && tokens.size(0) == R, "decode_rows: expected one token per row (",
            R, "), got ", tokens.sizes());
  std::vector<int64_t> lengths;
  for (const DecodeCache* k : caches) {
    LVX_CHECK(k->batch == 1, "decode_rows: each row's cache holds one sample, got ", k->batch);
    lengths.push_back(k->length);
  }
  return at::tensor(lengths, at::kLong).to(device).unsqueeze(1);
}

namespace {

// Row r's key tensors in `layer` (prompt, or visual), and whether two rows hold the same ones.
const KVShard& row_keys(const DecodeCache& c, size_t layer, bool visual) {
  return visual ? c.visual[layer] : c.prompt[layer];
}
bool same_keys(const KVShard& a, const KVShard& b) {
  return a.k.is_same(b.k) && a.v.is_same(b.v) && a.visible.defined() == b.visible.defined() &&
         (!a.visible.defined() || a.visible.is_same(b.visible));
}

at::Tensor index_on(const std::vector<int64_t>& v, const at::Device& device) {
  return at::tensor(v, at::kLong).to(device);
}

}  // namespace

Partial rows_cached_partial(const at::Tensor& q, const std::vector<int64_t>& lengths,
                            const std::vector<DecodeCache*>& caches, size_t layer, bool visual,
                            double scale) {
  const size_t R = caches.size();
  std::vector<int64_t> start(R + 1, 0);
  for (size_t r = 0; r < R; ++r) start[r + 1] = start[r] + lengths[r];
  // The rows with keys, grouped by the tensors they hold (in order of each group's first row).
  std::vector<std::vector<size_t>> groups;
  std::vector<bool> grouped(R, false);
  size_t with_keys = 0;
  for (size_t r = 0; r < R; ++r) {
    const KVShard& kv = row_keys(*caches[r], layer, visual);
    if (grouped[r] || !kv.k.defined()) continue;
    groups.emplace_back();
    for (size_t s = r; s < R; ++s)
      if (!grouped[s] && row_keys(*caches[s], layer, visual).k.defined() &&
          same_keys(row_keys(*caches[s], layer, visual), kv)) {
        groups.back().push_back(s);
        grouped[s] = true;
        ++with_keys;
      }
  }
  if (groups.empty()) return {};
  auto call = [&](const at::Tensor& queries, size_t g) {
    const KVShard& kv = row_keys(*caches[groups[g].front()], layer, visual);
    return shared_partial_attention(queries, kv.k, kv.v, kv.visible, scale);
  };
  if (groups.size() == 1 && with_keys == R) return call(q, 0);  // every row, in order
  // Each group's tokens gathered (one call each); the outputs put back in row order.
  std::vector<at::Tensor> o, lse;
  std::vector<int64_t> at_of(R, -1);  // where row r's first output sits in the groups' order
  int64_t out = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<int64_t> tokens;
    for (size_t r : groups[g]) {
      at_of[r] = out;
      out += lengths[r];
      for (int64_t t = start[r]; t < start[r + 1]; ++t) tokens.push_back(t);
    }
    const Partial p = call(q.index_select(0, index_on(tokens, q.device())), g);
    o.push_back(p.o);
    lse.push_back(p.lse);
  }
  std::vector<int64_t> order;  // rows with keys, in row order
  for (size_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < (at_of[r] < 0 ? 0 : lengths[r]); ++t) order.push_back(at_of[r] + t);
  const at::Tensor back = index_on(order, q.device());
  return {at::cat(o, 0).index_select(0, back), at::cat(lse, 0).index_select(0, back)};
}

namespace {

// The padded layout of `rows` (a part of a rows forward whose tokens start at `start`).
RowsLayout::Part layout_part(const std::vector<size_t>& rows, const std::vector<int64_t>& start,
                             const std::vector<int64_t>& lengths,
                             const std::vector<int64_t>& before, const at::Device& device) {
  RowsLayout::Part p;
  p.rows = rows;
  for (size_t r : rows) {
    p.longest = std::max(p.longest, lengths[r]);
    p.keys = std::max(p.keys, before[r] + lengths[r]);
  }
  const auto R = static_cast<int64_t>(rows.size());
  const int64_t T = p.longest, L = p.keys;
  std::vector<int64_t> to_padded, to_part, key_slots;
  std::vector<uint8_t> hidden(static_cast<size_t>(R * T * L));
  int64_t key0 = 0;
  for (int64_t i = 0; i < R; ++i) {
    const size_t r = rows[static_cast<size_t>(i)];
    const int64_t n = lengths[r], b = before[r];
    for (int64_t t = 0; t < T; ++t) {
      to_padded.push_back(start[r] + std::min(t, n - 1));  // padding: the row's last token
      if (t < n) to_part.push_back(i * T + t);
      for (int64_t j = 0; j < L; ++j)  // causal; a padding slot sees what the row's last does
        hidden[static_cast<size_t>((i * T + t) * L + j)] = j > b + std::min(t, n - 1);
    }
    for (int64_t j = 0; j < L; ++j) key_slots.push_back(key0 + std::min(j, b + n - 1));
    key0 += b + n;
  }
  auto on_device = [&](const std::vector<int64_t>& v) {
    return at::tensor(v, at::kLong).to(device);
  };
  p.to_padded = on_device(to_padded);
  p.to_part = on_device(to_part);
  p.key_slots = on_device(key_slots);
  p.hidden = at::from_blob(hidden.data(), {R, 1, 1, T, L}, at::kByte).to(device, at::kBool);
  return p;
}

// One part's tokens against their rows' new keys: [N_part, Hq, D] / [N_part, Hq], row order.
Partial part_new_keys(const at::Tensor& q, const std::vector<DecodeCache*>& caches, size_t layer,
                      const RowsLayout::Part& part, double scale) {
  // The part's rows' pieces (one per step) in one concatenation; a row's list is merged into
  // one piece now and then, not at every step.
  std::vector<at::Tensor> k, v;
  for (size_t r : part.rows) {
    DecodeCache& kc = *caches[r];
    if (kc.new_k[layer].size() > 16) new_keys(kc, layer);
    k.insert(k.end(), kc.new_k[layer].begin(), kc.new_k[layer].end());
    v.insert(v.end(), kc.new_v[layer].begin(), kc.new_v[layer].end());
  }
  const auto R = static_cast<int64_t>(part.rows.size());
  const int64_t T = part.longest, L = part.keys;
  const int64_t hq = q.size(1), D = q.size(2), hkv = k[0].size(2), g = hq / hkv;
  const auto acc = kernels::accumulation_dtype(q.scalar_type());
  auto slots = [&](const std::vector<at::Tensor>& x) {  // [R, L_max] slots: one gather, no pads
    const at::Tensor all = x.size() == 1 ? x[0] : at::cat(x, 1);
    return all.index_select(1, part.key_slots).view({R, L, hkv, -1}).to(acc);
  };
  // Each (row, K/V head) one batch of a bmm, its g query heads' T tokens as rows: two bmm and
  // in-place softmax steps, no broadcast copies (a decode step runs this per layer).
  const at::Tensor kk = slots(k).permute({0, 2, 3, 1}).reshape({R * hkv, D, L});
  const at::Tensor vv = slots(v).permute({0, 2, 1, 3}).reshape({R * hkv, L, -1});
  const at::Tensor qq = q.index_select(0, part.to_padded)
                            .to(acc)
                            .view({R, T, hkv, g, D})
                            .permute({0, 2, 3, 1, 4})
                            .reshape({R * hkv, g * T, D});
  at::Tensor sc = at::bmm(qq, kk).mul_(scale);  // [R·Hkv, g·T, L]
  sc.view({R, hkv, g, T, L}).masked_fill_(part.hidden, -std::numeric_limits<double>::infinity());
  at::Tensor lse = sc.amax(-1, /*keepdim=*/true);  // every token sees its own key: finite
  sc.sub_(lse).exp_();
  const at::Tensor sum = sc.sum(-1, /*keepdim=*/true);
  const at::Tensor o = at::bmm(sc, vv).div_(sum);  // [R·Hkv, g·T, Dv]
  lse.add_(sum.log());
  const int64_t Dv = o.size(-1);
  return {o.view({R, hkv, g, T, Dv})
              .permute({0, 3, 1, 2, 4})
              .reshape({R * T, hq, Dv})
              .index_select(0, part.to_part),
          lse.view({R, hkv, g, T})
              .permute({0, 3, 1, 2})
              .reshape({R * T, hq})
              .index_select(0, part.to_part)};
}

}  // namespace

RowsLayout rows_layout(const std::vector<int64_t>& lengths, const std::vector<int64_t>& before,
                       const at::Device& device) {
  RowsLayout l;
  l.lengths = lengths;
  l.before = before;
  const size_t R = lengths.size();
  std::vector<int64_t> start(R + 1, 0);
  for (size_t r = 0; r < R; ++r) start[r + 1] = start[r] + lengths[r];
  l.tokens = start[R];
  // One-token rows (decode steps) and longer ones (questions) padded apart: a question's length
  // would pad every decode row's one query to it.
  std::vector<size_t> one, longer;
  for (size_t r = 0; r < R; ++r) (lengths[r] == 1 ? one : longer).push_back(r);
  for (const std::vector<size_t>* rows : {&one, &longer})
    if (!rows->empty()) l.parts.push_back(layout_part(*rows, start, lengths, before, device));
  if (!one.empty() && !longer.empty()) {  // the parts' outputs side by side, back in row order
    std::vector<int64_t> at(R), to_flat;
    int64_t out = 0;
    for (const RowsLayout::Part& p : l.parts)
      for (size_t r : p.rows) {
        at[r] = out;
        out += lengths[r];
      }
    for (size_t r = 0; r < R; ++r)
      for (int64_t t = 0; t < lengths[r]; ++t) to_flat.push_back(at[r] + t);
    l.to_flat = at::tensor(to_flat, at::kLong).to(device);
  }
  return l;
}

Partial rows_new_keys(const at::Tensor& q, const std::vector<DecodeCache*>& caches, size_t layer,
                      const RowsLayout& layout, double scale) {
  if (layout.parts.size() == 1) return part_new_keys(q, caches, layer, layout.parts[0], scale);
  std::vector<at::Tensor> o, lse;
  for (const RowsLayout::Part& part : layout.parts) {
    const Partial p = part_new_keys(q, caches, layer, part, scale);
    o.push_back(p.o);
    lse.push_back(p.lse);
  }
  return {at::cat(o, 0).index_select(0, layout.to_flat),
          at::cat(lse, 0).index_select(0, layout.to_flat)};
}

Partial generated_partial(const at::Tensor& q, const std::vector<DecodeCache*>& caches,
                          size_t layer, double scale) {
  if (caches.size() == 1) {  // decode_step's products, bit for bit
    const auto [nk, nv] = new_keys(*caches[0], layer);
    return partial_attention(q, nk, nv, {}, scale);
  }
  std::vector<int64_t> ones(caches.size(), 1), before;
  for (const DecodeCache* kc : caches) before.push_back(new_key_count(*kc, layer) - 1);
  return rows_new_keys(q, caches, layer, rows_layout(ones, before, q.device()), scale);
}

Partial rows_over_cache(const at::Tensor& q, const std::vector<DecodeCache*>& caches, size_t layer,
                        bool visual, dist::ProcessGroup& pg, double scale) {
  const std::vector<int64_t> ones(caches.size(), 1);
  return merge_across_ranks(pg, {rows_cached_partial(q, ones, caches, layer, visual, scale)})[0];
}

int64_t pass_q_bytes(int world, int64_t attentions, int64_t batch, int64_t heads,
                     int64_t head_dim) {
  return static_cast<int64_t>(world - 1) * attentions * batch * heads * (head_dim + 1) * 4;
}

}  // namespace lvx::models
