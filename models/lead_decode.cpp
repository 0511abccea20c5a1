#include "models/lead_decode.h"

#include "kernels/attention.h"
#include "src/common/error.h"

namespace lvx::models {

namespace {

// The layers whose cache holds prompt keys, and those keys' shape ([B, S_r, Hkv, D]).
std::vector<size_t> prompt_layers(const DecodeCache& cache) {
  std::vector<size_t> layers;
  for (size_t l = 0; l < cache.prompt.size(); ++l)
    if (cache.prompt[l].k.defined()) layers.push_back(l);
  return layers;
}

// This rank's prompt keys of `layers` as one message, the tokens first: [S_r, 2, layers, B, Hkv,
// D] (k, then v).
at::Tensor pack_prompt(const DecodeCache& cache, const std::vector<size_t>& layers) {
  std::vector<at::Tensor> k, v;
  for (size_t l : layers) {
    k.push_back(cache.prompt[l].k);
    v.push_back(cache.prompt[l].v);
  }
  return at::stack({at::stack(k), at::stack(v)}).permute({3, 0, 1, 2, 4, 5}).contiguous();
}

// Which of this rank's prompt keys are real (not padding): uint8 [S_r, B].
at::Tensor pack_valid(const KVShard& shard, int64_t batch) {
  const int64_t S = shard.k.size(1);
  if (!shard.visible.defined()) return at::ones({S, batch}, shard.k.options().dtype(at::kByte));
  return shard.visible.to(at::kByte).transpose(0, 1).contiguous();
}

}  // namespace

bool leads_decode(const Parallel& par) { return par.lead_decode && par.world() > 1; }

void gather_prompt_to_lead(dist::ProcessGroup& pg, DecodeCache& cache) {
  if (cache.prompt_whole) return;
  const std::vector<size_t> layers = prompt_layers(cache);
  if (layers.empty()) {
    cache.prompt_whole = true;
    return;
  }
  // Every rank's token count (the shards of a prompt split over the ranks differ by one).
  const KVShard& first = cache.prompt[layers[0]];
  const at::Tensor count = at::full({1}, first.k.size(1), at::kLong);
  const at::Tensor counts = pg.all_gather(count);
  std::vector<int64_t> sizes(counts.data_ptr<int64_t>(),
                             counts.data_ptr<int64_t>() + counts.numel());
  const at::Tensor keys = pg.all_gather(pack_prompt(cache, layers), sizes);
  const at::Tensor valid = pg.all_gather(pack_valid(first, cache.batch), sizes);
  cache.prompt_whole = true;
  if (pg.rank() != 0) return;  // the others keep their shard, which lead decoding never reads
  const at::Tensor visible = shard_visible(valid.transpose(0, 1).to(at::kBool).contiguous());
  for (size_t j = 0; j < layers.size(); ++j) {
    const int64_t i = static_cast<int64_t>(j);
    KVShard& shard = cache.prompt[layers[j]];
    shard.k = keys.select(1, 0).select(1, i).transpose(0, 1).contiguous();  // [B, S, Hkv, D]
    shard.v = keys.select(1, 1).select(1, i).transpose(0, 1).contiguous();
    shard.visible = visible;
  }
}

Partial prompt_over_ranks(dist::ProcessGroup& pg, const DecodeCache& cache, size_t layer,
                          const at::Tensor& q, double scale) {
  const KVShard& p = cache.prompt[layer];
  const Partial local = partial_attention(q, p.k, p.v, p.visible, scale);
  return cache.prompt_whole ? local : merge_across_ranks(pg, {local})[0];
}

Partial visual_over_ranks(const Parallel& par, const at::Tensor& q, const KVShard& vis,
                          double scale) {
  if (!leads_decode(par))
    return merge_across_ranks(*par.pg, {partial_attention(q, vis.k, vis.v, vis.visible, scale)})[0];
  LVX_CHECK(q.scalar_type() == vis.k.scalar_type(), "lead decoding: the query's dtype (",
            q.scalar_type(), ") is not its visual keys' (", vis.k.scalar_type(), ")");
  // The query to every other rank and their partials back, posted at once; this rank's own
  // partial is computed while they compute theirs.
  dist::ProcessGroup& pg = *par.pg;
  const int n = pg.world_size();
  const at::Tensor sent = q.contiguous();
  const int64_t B = q.size(0), hq = q.size(1), D = q.size(2);
  const auto acc = q.options().dtype(kernels::accumulation_dtype(q.scalar_type()));
  std::vector<at::Tensor> got;
  std::vector<dist::P2POp> ops;
  for (int r = 1; r < n; ++r) {
    ops.push_back(dist::P2POp::send(sent, r));
    got.push_back(at::empty({B, hq, D + 1}, acc));
    ops.push_back(dist::P2POp::recv(got.back(), r));
  }
  dist::Work work = pg.batch_isend_irecv(std::move(ops), "lead decoding: cross query");
  std::vector<Partial> parts{partial_attention(q, vis.k, vis.v, vis.visible, scale)};
  work.wait();
  for (const at::Tensor& x : got) parts.push_back(unpack_partial(x));
  return merge_partials(parts);  // in rank order, as merge_across_ranks merges
}

at::Tensor lead_decode_step(const Model& model, const at::Tensor& tokens, const Parallel& par,
                            DecodeCache& cache) {
  if (par.rank() != 0) {
    serve_visual_partials(model.decode_cross_calls(), par, cache);
    return {};
  }
  gather_prompt_to_lead(*par.pg, cache);
  return with_threads(par.lead_threads, [&] { return model.decode_step(tokens, par, cache); });
}

void serve_visual_partials(const std::vector<CrossCall>& calls, const Parallel& par,
                           DecodeCache& cache) {
  LVX_CHECK(par.rank() != 0, "serve_visual_partials: rank 0 runs the decode step itself");
  gather_prompt_to_lead(*par.pg, cache);
  for (const CrossCall& call : calls) {
    const KVShard& vis = cache.visual.at(static_cast<size_t>(call.layer));
    if (!vis.k.defined()) continue;  // rank 0's step skips it too
    const at::Tensor q = at::empty({cache.batch, call.heads, call.head_dim}, vis.k.options());
    par.pg->batch_isend_irecv({dist::P2POp::recv(q, 0)}, "lead decoding: cross query").wait();
    const Partial p = partial_attention(q, vis.k, vis.v, vis.visible, call.scale);
    const at::Tensor packed = pack_partial(p).contiguous();
    par.pg->batch_isend_irecv({dist::P2POp::send(packed, 0)}, "lead decoding: cross partial")
        .wait();
  }
  ++cache.length;
}

}  // namespace lvx::models
