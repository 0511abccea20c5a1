#include "src/attention/layout.h"

#include "src/common/error.h"

namespace lvx::attention {

int64_t Layout::local_size(int rank) const {
  LVX_CHECK(rank >= 0 && rank < world, "layout: rank ", rank, " outside [0, ", world, ")");
  if (kind == LayoutKind::kStriped) return total > rank ? (total - rank + world - 1) / world : 0;
  return total / world + (rank < total % world ? 1 : 0);
}

std::vector<int64_t> Layout::sizes() const {
  std::vector<int64_t> s(world);
  for (int r = 0; r < world; ++r) s[r] = local_size(r);
  return s;
}

at::Tensor Layout::positions(int rank) const {
  const int64_t n = local_size(rank);
  if (kind == LayoutKind::kStriped) return at::arange(n, at::kLong) * world + rank;
  int64_t off = 0;
  for (int r = 0; r < rank; ++r) off += local_size(r);
  return at::arange(off, off + n, at::kLong);
}

at::Tensor Layout::shard(const at::Tensor& global, int64_t dim, int rank) const {
  LVX_CHECK(global.size(dim) == total, "layout: tensor has ", global.size(dim),
            " tokens in dimension ", dim, " but the layout was made for ", total);
  return global.index_select(dim, positions(rank).to(global.device())).contiguous();
}

at::Tensor Layout::unshard(const std::vector<at::Tensor>& shards, int64_t dim) const {
  LVX_CHECK(static_cast<int>(shards.size()) == world, "layout: ", shards.size(),
            " shards for ", world, " ranks");
  at::Tensor cat = at::cat(shards, dim);
  if (kind == LayoutKind::kContiguous) return cat;
  std::vector<at::Tensor> pos;
  for (int r = 0; r < world; ++r) pos.push_back(positions(r));
  at::Tensor inverse = at::argsort(at::cat(pos));
  return cat.index_select(dim, inverse.to(cat.device()));
}

}  // namespace lvx::attention
