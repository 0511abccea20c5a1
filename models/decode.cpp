#include "models/decode.h"

#include <limits>

#include "kernels/attention.h"
#include "src/common/error.h"

namespace lvx::models {

Partial partial_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& visible, double scale) {
  const int64_t B = q.size(0), hq = q.size(1), D = q.size(2), S = k.size(1);
  if (S == 0) {  // no key on this rank (the kernels take at least one)
    const auto acc = q.options().dtype(kernels::accumulation_dtype(q.scalar_type()));
    return {at::zeros({B, hq, D}, acc),
            at::full({B, hq}, -std::numeric_limits<double>::infinity(), acc)};
  }
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

int64_t pass_q_bytes(int world, int64_t attentions, int64_t batch, int64_t heads,
                     int64_t head_dim) {
  return static_cast<int64_t>(world - 1) * attentions * batch * heads * (head_dim + 1) * 4;
}

}  // namespace lvx::models
