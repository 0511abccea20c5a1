#include "models/decode.h"

#include <limits>

#include "src/common/error.h"

namespace lvx::models {

Partial partial_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& visible, double scale) {
  const int64_t B = q.size(0), hq = q.size(1), D = q.size(2), hkv = k.size(2), S = k.size(1);
  LVX_CHECK(hq % hkv == 0, "decode: ", hq, " query heads are not groups of ", hkv, " key heads");
  if (S == 0) {
    return {
        at::zeros({B, hq, D}, q.options().dtype(at::kFloat)),
        at::full({B, hq}, -std::numeric_limits<float>::infinity(), q.options().dtype(at::kFloat))};
  }
  // [B, Hkv, G, D] · [B, Hkv, D, S] → [B, Hkv, G, S]: each key head serves its G query heads.
  const at::Tensor qg = q.to(at::kFloat).view({B, hkv, hq / hkv, D});
  const at::Tensor kt = k.to(at::kFloat).permute({0, 2, 3, 1});
  at::Tensor s = at::matmul(qg, kt) * scale;
  if (visible.defined())
    s = s.masked_fill(visible.logical_not().view({B, 1, 1, S}),
                      -std::numeric_limits<float>::infinity());
  const at::Tensor lse = at::logsumexp(s, -1, /*keepdim=*/true);  // −inf: no visible key
  const at::Tensor p = at::exp(s - lse).nan_to_num(0.0);  // exp(−inf − −inf) = nan → 0
  const at::Tensor o = at::matmul(p, v.to(at::kFloat).transpose(1, 2));  // [B, Hkv, G, D]
  return {o.reshape({B, hq, D}), lse.reshape({B, hq})};
}

Partial merge_partials(const std::vector<Partial>& parts) {
  LVX_CHECK(!parts.empty(), "decode: nothing to merge");
  if (parts.size() == 1) return parts[0];
  std::vector<at::Tensor> lses;
  for (const Partial& p : parts) lses.push_back(p.lse);
  const at::Tensor lse = at::logsumexp(at::stack(lses), 0);  // −inf when every part is empty
  at::Tensor o = at::zeros_like(parts[0].o);
  for (const Partial& p : parts) o = o + (at::exp(p.lse - lse).nan_to_num(0.0)).unsqueeze(-1) * p.o;
  return {o, lse};
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
