#include "src/attention/layout.h"

#include "src/common/error.h"

namespace lvx::attention {

int64_t Layout::local_size(int rank) const {
  LVX_CHECK(rank >= 0 && rank < world, "layout: rank ", rank, " outside [0, ", world, ")");
  LVX_CHECK(unit >= 1 && total % unit == 0, "layout: ", total, " tokens are not whole blocks of ",
            unit);
  const int64_t blocks = total / unit;
  if (kind == LayoutKind::kStriped)
    return (blocks > rank ? (blocks - rank + world - 1) / world : 0) * unit;
  return (blocks / world + (rank < blocks % world ? 1 : 0)) * unit;
}

std::vector<int64_t> Layout::sizes() const {
  std::vector<int64_t> s(world);
  for (int r = 0; r < world; ++r) s[r] = local_size(r);
  return s;
}

at::Tensor Layout::positions(int rank) const {
  const int64_t n = local_size(rank);
  at::Tensor blocks;  // this rank's block indices
  if (kind == LayoutKind::kStriped) {
    blocks = at::arange(n / unit, at::kLong) * world + rank;
  } else {
    int64_t off = 0;
    for (int r = 0; r < rank; ++r) off += local_size(r);
    blocks = at::arange(off / unit, (off + n) / unit, at::kLong);
  }
  if (unit == 1) return blocks;
  return (blocks.unsqueeze(1) * unit + at::arange(unit, at::kLong).unsqueeze(0)).reshape({-1});
}

at::Tensor Layout::gathered_positions() const {
  std::vector<at::Tensor> pos;
  for (int r = 0; r < world; ++r) pos.push_back(positions(r));
  return at::cat(pos);
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
  at::Tensor inverse = at::argsort(gathered_positions());
  return cat.index_select(dim, inverse.to(cat.device()));
}

}  // namespace lvx::attention
