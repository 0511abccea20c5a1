// Independent closed forms of the bytes each rank moves in a collective, for the tests that check
// the byte counters (tests/test_dist.cpp on Gloo, tests/gpu/dist_device.cpp on Gloo or NCCL).
// Written from the engines' algorithms, not from lvx's counting code (src/dist/collectives.cpp),
// so a counting slip there shows up as a mismatch here.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace lvx::test {

// How many times rank r sends in a binomial-tree broadcast from `root` over w ranks (Gloo's
// gloo/broadcast.cc): in step i the virtual ranks v = r − root below 2^i send to v + 2^i (when
// that is a rank), so v sends once for every 2^i above it; the root ⌈log2 w⌉ times.
inline int tree_sends(int r, int root, int w) {
  const int v = (r - root + w) % w;
  int sends = 0;
  for (int i = 0; (1 << i) < w; ++i) sends += v < (1 << i) && v + (1 << i) < w ? 1 : 0;
  return sends;
}

// NCCL's broadcast is a ring chain from the root: every rank forwards to next but the one before
// the root.
inline int chain_sends(int r, int root, int w) { return w > 1 && (r + 1) % w != root ? 1 : 0; }

inline int broadcast_sends(int r, int root, int w, bool nccl) {
  return nccl ? chain_sends(r, root, w) : tree_sends(r, root, w);
}

struct Volume {
  int64_t sent = 0, received = 0;
};

// all_gather on the engine's collective (NCCL's; Gloo's with CollectiveImpl::kEngine) of rank j's
// sizes[j] rows of row_bytes: the ring of chunks padded to the largest when
// the sizes are at most one row apart ((w − 1) padded chunks each way), else a broadcast from each
// owner of its piece.
inline Volume all_gather_volume(int r, const std::vector<int64_t>& sizes, int64_t row_bytes,
                                bool nccl) {
  const int w = static_cast<int>(sizes.size());
  Volume v;
  if (w <= 1) return v;
  const int64_t most = *std::max_element(sizes.begin(), sizes.end());
  const int64_t least = *std::min_element(sizes.begin(), sizes.end());
  if (most - least <= 1) {
    v.sent = v.received = (w - 1) * most * row_bytes;
    return v;
  }
  for (int j = 0; j < w; ++j) {
    v.sent += broadcast_sends(r, j, w, nccl) * sizes[j] * row_bytes;
    if (j != r) v.received += sizes[j] * row_bytes;
  }
  return v;
}

// all_gather as lvx's ring of messages (collectives_p2p.cpp; Gloo's default): in step s rank r
// passes piece r − s on to next, so it sends every piece but next's and receives every one but
// its own, unpadded.
inline Volume ring_all_gather_volume(int r, const std::vector<int64_t>& sizes, int64_t row_bytes) {
  const int w = static_cast<int>(sizes.size());
  Volume v;
  if (w <= 1) return v;
  for (int j = 0; j < w; ++j) {
    if (j != (r + 1) % w) v.sent += sizes[j] * row_bytes;
    if (j != r) v.received += sizes[j] * row_bytes;
  }
  return v;
}

}  // namespace lvx::test
