// Several generations at once (continuous batching: Model::decode_rows / extend_rows, lvx
// serve's steps): the rows' generated keys in one pool (models/row_key_pool.h), their cached
// keys read per group of rows holding the same tensors, their own new keys in one padded
// product. Declared in models/decode.h beside the single generation's helpers.
#include <algorithm>

#include "kernels/attention.h"
#include "kernels/slot_attention.h"
#include "models/decode.h"
#include "src/common/error.h"

namespace lvx::models {

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
  int64_t n = cache.pooled ? cache.pooled.pool()->used(layer, cache.pooled.index()) : 0;
  for (const at::Tensor& k : cache.new_k[layer]) n += k.size(1);
  return n;
}

namespace {

// A row stepping alone again (decode_step, extend): its pooled keys become the first piece of
// each layer's list, and its slot is released.
void leave_pool(DecodeCache& cache) {
  const RowSlot& s = cache.pooled;
  for (size_t l = 0; l < cache.new_k.size(); ++l) {
    if (s.pool()->used(l, s.index()) == 0) continue;
    auto [k, v] = s.pool()->slot_keys(l, s.index());
    cache.new_k[l].insert(cache.new_k[l].begin(), k);
    cache.new_v[l].insert(cache.new_v[l].begin(), v);
  }
  cache.pooled.reset();
}

// Moves `cache` into `pool` (its keys copied: an earlier pool's slot, then its pieces), or, when
// it is there already, its pieces (steps it took alone) after its slot's keys.
void join_pool(DecodeCache& cache, const std::shared_ptr<RowKeyPool>& pool) {
  if (cache.pooled.pool() != pool.get()) {
    if (cache.pooled) leave_pool(cache);
    cache.pooled = RowSlot(pool, pool->acquire());
  }
  for (size_t l = 0; l < cache.new_k.size(); ++l) {
    for (size_t i = 0; i < cache.new_k[l].size(); ++i)
      pool->append(l, cache.pooled.index(), cache.new_k[l][i][0], cache.new_v[l][i][0]);
    cache.new_k[l].clear();
    cache.new_v[l].clear();
  }
}

}  // namespace

void push_rows_keys(const std::vector<DecodeCache*>& caches, size_t layer, const at::Tensor& k,
                    const at::Tensor& v, const std::vector<int64_t>& counts) {
  if (caches.size() == 1) {
    if (caches[0]->pooled) leave_pool(*caches[0]);
    caches[0]->new_k[layer].push_back(k.unsqueeze(0));
    caches[0]->new_v[layer].push_back(v.unsqueeze(0));
    return;
  }
  std::shared_ptr<RowKeyPool> pool = caches[0]->pooled.shared_pool();
  if (!pool) pool = std::make_shared<RowKeyPool>(caches[0]->new_k.size());
  std::vector<int64_t> slots;
  for (DecodeCache* c : caches) {
    // Steady state (every row in the pool, no pieces): a pointer and a size compared per row. A
    // row that stepped alone has pieces in every layer with self-attention, this one too.
    if (c->pooled.pool() != pool.get() || !c->new_k[layer].empty()) join_pool(*c, pool);
    slots.push_back(c->pooled.index());
  }
  pool->append_rows(layer, slots, counts, k, v);
}

std::pair<at::Tensor, at::Tensor> new_keys(DecodeCache& cache, size_t layer) {
  if (cache.pooled) leave_pool(cache);
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

// Whether the groups are runs of rows 0, 1, .. in order (each group's rows consecutive).
bool in_runs(const std::vector<std::vector<size_t>>& groups) {
  size_t next = 0;
  for (const std::vector<size_t>& g : groups)
    for (size_t r : g)
      if (r != next++) return false;
  return true;
}

// The key tensors that tell a row's cached video (or prompt) apart: its first layer's with
// prompt keys, and its first with visual keys.
std::pair<const void*, const void*> keys_of(const DecodeCache& c) {
  auto first = [](const std::vector<KVShard>& layers) -> const void* {
    for (const KVShard& kv : layers)
      if (kv.k.defined()) return kv.k.unsafeGetTensorImpl();
    return nullptr;
  };
  return {first(c.prompt), first(c.visual)};
}

// Each group's tokens for calls over its keys: indices into the rows' tokens q.
using GroupTokens = std::vector<std::vector<int64_t>>;

// Calls' outputs side by side, and the token each output row is for (-1: a padding slot).
struct Calls {
  std::vector<at::Tensor> o, lse;
  std::vector<int64_t> token;

  // A call's partial p over `tokens` (its output rows, in order).
  void add(const Partial& p, const std::vector<int64_t>& tokens) {
    o.push_back(p.o);
    lse.push_back(p.lse);
    token.insert(token.end(), tokens.begin(), tokens.end());
  }

  // The outputs of the tokens (of N) that have one, in token order: [N', Hq, D] / [N', Hq], one
  // gather.
  Partial in_token_order(int64_t N, const at::Device& device) const {
    std::vector<int64_t> at_of(static_cast<size_t>(N), -1), rows;
    for (size_t i = 0; i < token.size(); ++i)
      if (token[i] >= 0) at_of[static_cast<size_t>(token[i])] = static_cast<int64_t>(i);
    for (int64_t i : at_of)
      if (i >= 0) rows.push_back(i);
    const at::Tensor back = index_on(rows, device);
    auto joined = [](const std::vector<at::Tensor>& x) {
      return x.size() == 1 ? x[0] : at::cat(x);
    };
    return {joined(o).index_select(0, back), joined(lse).index_select(0, back)};
  }
};

// The tokens of every group in one call over the groups' stacked keys k, v [S, P, Hkv, D]
// (group g's at places[g]): each group's tokens padded to the most any has, a padding slot
// repeating a token of q (its output is dropped).
void stacked_call(Calls& calls, const at::Tensor& q, const GroupTokens& tokens,
                  const std::vector<int64_t>& places, const at::Tensor& k, const at::Tensor& v,
                  double scale) {
  const int64_t S = k.size(0), hq = q.size(1), D = q.size(2);
  int64_t most = 0;
  for (const std::vector<int64_t>& t : tokens)
    most = std::max(most, static_cast<int64_t>(t.size()));
  std::vector<int64_t> slot_token(static_cast<size_t>(S * most), 0);
  const size_t first = calls.token.size();
  calls.token.resize(first + slot_token.size(), -1);
  for (size_t g = 0; g < tokens.size(); ++g)
    for (size_t t = 0; t < tokens[g].size(); ++t) {
      const auto slot = static_cast<size_t>(places[g] * most) + t;
      slot_token[slot] = tokens[g][t];
      calls.token[first + slot] = tokens[g][t];
    }
  kernels::AttentionParams params;
  params.scale = scale;
  const at::Tensor slots =
      q.index_select(0, index_on(slot_token, q.device())).view({S, most, hq, D});
  const kernels::AttentionOutput out = kernels::attention_forward(slots, k, v, params);
  calls.o.push_back(out.o.view({S * most, hq, out.o.size(3)}));
  calls.lse.push_back(out.lse.transpose(1, 2).reshape({S * most, hq}));
}

// Whether tokens stacked lose at most half the call to padding (S slots of the most any group
// has, for n tokens).
bool little_padding(const GroupTokens& tokens, int64_t n) {
  size_t most = 0;
  for (const std::vector<int64_t>& t : tokens) most = std::max(most, t.size());
  return n > 0 && static_cast<int64_t>(tokens.size() * most) <= 2 * n;
}

// The groups' prompt keys in one attention call over their stack (RowKeyPool::stacked_keys)
// instead of a call per group. Videos sampled to one frame count with one template have prompts
// of one length, and a step's calls over these short keys cost mostly their fixed part (~40 us
// a call on one CPU thread, whatever its handful of queries: docs/serve.md). Every token in the
// stacked call when padding to the group with the most tokens costs at most half of it; else
// (a long question joining) the one-token rows stacked and the longer rows' tokens in a call per
// group. Undefined (the caller makes a call per group) unless every group holds unmasked keys
// of one shape and the rows are in a pool. Visual keys are never stacked: that would copy every
// video's visual K/V.
Partial stacked_partial(const at::Tensor& q, const std::vector<int64_t>& start,
                        const std::vector<std::vector<size_t>>& groups,
                        const std::vector<DecodeCache*>& caches, size_t layer, double scale) {
  RowKeyPool* pool = caches[groups.front().front()]->pooled.pool();
  if (pool == nullptr || groups.size() < 2) return {};
  const KVShard& first = row_keys(*caches[groups.front().front()], layer, false);
  std::vector<std::pair<at::Tensor, at::Tensor>> sources;
  GroupTokens all(groups.size()), ones(groups.size()), longer(groups.size());
  int64_t n_ones = 0;
  for (size_t g = 0; g < groups.size(); ++g) {
    const KVShard& kv = row_keys(*caches[groups[g].front()], layer, false);
    if (kv.visible.defined() || kv.k.size(0) != 1 || kv.k.size(1) == 0 ||
        kv.k.sizes() != first.k.sizes() || kv.v.sizes() != first.v.sizes() ||
        kv.k.scalar_type() != first.k.scalar_type())
      return {};
    sources.emplace_back(kv.k, kv.v);
    for (size_t r : groups[g]) {
      const bool one = start[r + 1] - start[r] == 1;
      n_ones += one ? 1 : 0;
      for (int64_t n = start[r]; n < start[r + 1]; ++n) {
        all[g].push_back(n);
        (one ? ones : longer)[g].push_back(n);
      }
    }
  }
  const int64_t N = q.size(0);
  const bool whole = little_padding(all, N);
  if (!whole && !little_padding(ones, n_ones)) return {};
  std::vector<int64_t> places;
  const auto [k, v] = pool->stacked_keys(layer, sources, places);
  Calls calls;
  stacked_call(calls, q, whole ? all : ones, places, k, v, scale);
  for (size_t g = 0; g < groups.size() && !whole; ++g) {
    if (longer[g].empty()) continue;
    const auto& [gk, gv] = sources[g];  // unmasked (checked above)
    calls.add(shared_partial_attention(q.index_select(0, index_on(longer[g], q.device())), gk, gv,
                                       {}, scale),
              longer[g]);
  }
  return calls.in_token_order(N, q.device());
}

}  // namespace

std::vector<size_t> rows_by_keys(const std::vector<const DecodeCache*>& caches) {
  std::vector<std::pair<const void*, const void*>> keys;
  for (const DecodeCache* c : caches) keys.push_back(keys_of(*c));
  std::vector<size_t> order, first(caches.size());  // first: the first row with r's keys
  for (size_t r = 0; r < caches.size(); ++r)
    first[r] = static_cast<size_t>(std::find(keys.begin(), keys.end(), keys[r]) - keys.begin());
  for (size_t r = 0; r < caches.size(); ++r) order.push_back(r);
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return first[a] < first[b]; });
  return order;
}

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
  if (!visual && with_keys == R) {
    const Partial stacked = stacked_partial(q, start, groups, caches, layer, scale);
    if (stacked.o.defined()) return stacked;
  }
  if (with_keys == R && in_runs(groups)) {  // rows_by_keys' order: each group's tokens a run
    std::vector<at::Tensor> o, lse;
    for (size_t g = 0; g < groups.size(); ++g) {
      const int64_t a = start[groups[g].front()], b = start[groups[g].back() + 1];
      const Partial p = call(q.narrow(0, a, b - a), g);
      o.push_back(p.o);
      lse.push_back(p.lse);
    }
    return {at::cat(o, 0), at::cat(lse, 0)};
  }
  // Each group's tokens gathered (one call each); the outputs put back in row order.
  Calls calls;
  for (size_t g = 0; g < groups.size(); ++g) {
    std::vector<int64_t> tokens;
    for (size_t r : groups[g])
      for (int64_t t = start[r]; t < start[r + 1]; ++t) tokens.push_back(t);
    calls.add(call(q.index_select(0, index_on(tokens, q.device())), g), tokens);
  }
  return calls.in_token_order(start[R], q.device());
}

namespace {

// The padded layout of `rows` (a part of a rows forward whose tokens start at `start`).
RowsLayout::Part layout_part(const std::vector<size_t>& rows, const std::vector<int64_t>& start,
                             const std::vector<int64_t>& lengths,
                             const std::vector<int64_t>& before, const at::Device& device) {
  RowsLayout::Part p;
  p.rows = rows;
  for (size_t r : rows) p.longest = std::max(p.longest, lengths[r]);
  const auto R = static_cast<int64_t>(rows.size());
  const int64_t T = p.longest;
  std::vector<int64_t> to_padded, to_part;
  for (int64_t i = 0; i < R; ++i) {
    const size_t r = rows[static_cast<size_t>(i)];
    const int64_t n = lengths[r], b = before[r];
    for (int64_t t = 0; t < T; ++t) {
      to_padded.push_back(start[r] + std::min(t, n - 1));  // padding: the row's last token
      if (t < n) to_part.push_back(i * T + t);
      p.sees.push_back(b + std::min(t, n - 1) + 1);  // causal; padding sees what the last does
    }
  }
  // Identities (every row one token, or all as long, and the part all tokens) stay undefined:
  // a decode step's rows need no gather.
  auto identity = [](const std::vector<int64_t>& v) {
    for (size_t i = 0; i < v.size(); ++i)
      if (v[i] != static_cast<int64_t>(i)) return false;
    return true;
  };
  if (!identity(to_padded) || static_cast<int64_t>(to_padded.size()) != start.back())
    p.to_padded = index_on(to_padded, device);
  if (!identity(to_part) || static_cast<int64_t>(to_part.size()) != R * T)
    p.to_part = index_on(to_part, device);
  return p;
}

// One part's tokens against their rows' new keys (in their pool: push_rows_keys): [N_part, Hq,
// D] / [N_part, Hq], row order. Each row reads its own slot, its front (the prompt keys) first
// and all visible, then its own keys up to its token's: one kernels::slot_attention call.
Partial part_new_keys(const at::Tensor& q, const std::vector<DecodeCache*>& caches, size_t layer,
                      const RowsLayout::Part& part, double scale, const PromptFront& front) {
  std::vector<int64_t> slots;
  std::vector<std::pair<at::Tensor, at::Tensor>> fronts;  // none: the slots' fronts dropped
  for (size_t r : part.rows) {
    slots.push_back(caches[r]->pooled.index());
    if (front) fronts.push_back(front.keys[r]);
  }
  RowKeyPool& pool = *caches[part.rows.front()]->pooled.pool();
  pool.set_fronts(layer, slots, fronts);  // no copy where a slot holds its front already
  std::vector<int64_t> sees = part.sees;
  for (int64_t& n : sees) n += front.length;
  const auto R = static_cast<int64_t>(part.rows.size());
  const auto [pk, pv] = pool.layer_keys(layer);
  const at::Tensor padded = (part.to_padded.defined() ? q.index_select(0, part.to_padded) : q)
                                .view({R, part.longest, q.size(1), q.size(2)});
  const kernels::SlotAttentionOutput out =
      kernels::slot_attention(padded, pk, pv, slots, sees, scale);
  auto of_part = [&part](const at::Tensor& x) {
    return part.to_part.defined() ? x.index_select(0, part.to_part) : x;
  };
  return {of_part(out.o.flatten(0, 1)), of_part(out.lse.flatten(0, 1))};
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
    l.to_flat = index_on(to_flat, device);
  }
  return l;
}

Partial rows_new_keys(const at::Tensor& q, const std::vector<DecodeCache*>& caches, size_t layer,
                      const RowsLayout& layout, double scale, const PromptFront& front) {
  if (caches.size() == 1) {  // one row keeps pieces (push_rows_keys): extend's product
    LVX_CHECK(!front, "rows_new_keys: a prompt front needs several rows in a pool");
    const auto [nk, nv] = new_keys(*caches[0], layer);
    return token_rows(causal_new_keys(q.unsqueeze(0), nk, nv, layout.before[0], scale));
  }
  if (layout.parts.size() == 1)
    return part_new_keys(q, caches, layer, layout.parts[0], scale, front);
  std::vector<at::Tensor> o, lse;
  for (const RowsLayout::Part& part : layout.parts) {
    const Partial p = part_new_keys(q, caches, layer, part, scale, front);
    o.push_back(p.o);
    lse.push_back(p.lse);
  }
  return {at::cat(o, 0).index_select(0, layout.to_flat),
          at::cat(lse, 0).index_select(0, layout.to_flat)};
}

PromptFront prompt_front(const std::vector<DecodeCache*>& caches, size_t layer,
                         const Parallel& par) {
  RowKeyPool* pool = caches.front()->pooled.pool();
  if (par.pg->world_size() != 1 || caches.size() < 2 || pool == nullptr) return {};
  const KVShard& first = caches.front()->prompt[layer];
  PromptFront p;
  for (const DecodeCache* c : caches) {
    const KVShard& kv = c->prompt[layer];
    if (c->pooled.pool() != pool || !kv.k.defined() || kv.visible.defined() || kv.k.size(0) != 1 ||
        kv.k.size(1) == 0 || kv.k.sizes() != first.k.sizes() || kv.v.sizes() != first.v.sizes() ||
        kv.k.scalar_type() != first.k.scalar_type())
      return {};
    p.keys.emplace_back(kv.k, kv.v);
  }
  if (static_cast<int64_t>(caches.size()) * first.k.numel() > par.prompt_front_elements) return {};
  p.length = first.k.size(1);
  return p;
}

Partial generated_partial(const at::Tensor& q, const std::vector<DecodeCache*>& caches,
                          size_t layer, double scale, const PromptFront& front) {
  if (caches.size() == 1) {  // decode_step's products, bit for bit
    const auto [nk, nv] = new_keys(*caches[0], layer);
    return partial_attention(q, nk, nv, {}, scale);
  }
  std::vector<int64_t> ones(caches.size(), 1), before;
  for (const DecodeCache* kc : caches) before.push_back(new_key_count(*kc, layer) - 1);
  return rows_new_keys(q, caches, layer, rows_layout(ones, before, q.device()), scale, front);
}

Partial rows_self_partial(const at::Tensor& q, const std::vector<DecodeCache*>& caches,
                          size_t layer, const Parallel& par, double scale) {
  const PromptFront front = prompt_front(caches, layer, par);
  if (front) return generated_partial(q, caches, layer, scale, front);
  return merge_partials({rows_over_cache(q, caches, layer, false, *par.pg, scale),
                         generated_partial(q, caches, layer, scale)});
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
