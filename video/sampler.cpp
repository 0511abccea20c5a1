// Sampling rules and rank sharding (see sampler.h for the formulas).
#include "video/sampler.h"

#include <algorithm>
#include <cmath>

#include "src/common/error.h"

namespace lvx::video {

int64_t played_at(const Timeline& tl, double t) {
  if (tl.pts.empty() || t >= tl.end) return -1;
  auto it = std::upper_bound(tl.pts.begin(), tl.pts.end(), t + kTimeEpsilon);
  return static_cast<int64_t>(it - tl.pts.begin()) - 1;
}

int64_t round_div_half_even(int64_t num, int64_t den) {
  int64_t q = num / den, r = num % den;
  if (2 * r > den || (2 * r == den && (q % 2) == 1)) ++q;
  return q;
}

SampledFrames sample_frames(const Timeline& tl, const SampleSpec& spec) {
  LVX_CHECK(spec.fps.has_value() != spec.num_frames.has_value(),
            "sampling: give exactly one of fps and num_frames (got ", spec.fps ? "both" : "neither",
            ")");
  LVX_CHECK(!tl.pts.empty(), "sampling: the video has no frames");
  const double first_pts = tl.pts.front();
  const double start = spec.start.value_or(first_pts);
  const double end = std::min(spec.end.value_or(tl.end), tl.end);
  LVX_CHECK(start < tl.end, "sampling: start ", start, " s is at or past the end of the video (",
            tl.end, " s)");
  LVX_CHECK(start < end, "sampling: start ", start, " s must be before end ", end, " s");
  LVX_CHECK(std::isfinite(start) && std::isfinite(end), "sampling: start and end must be finite");
  // Frames whose display starts in the range: what any sampling of it can give.
  const int64_t first = std::max<int64_t>(0, played_at(tl, start));
  const int64_t last =
      static_cast<int64_t>(std::lower_bound(tl.pts.begin(), tl.pts.end(), end - kTimeEpsilon) -
                           tl.pts.begin()) -
      1;
  const int64_t in_range = std::max<int64_t>(1, last - first + 1);
  const int64_t most = kMaxSamplesPerFrame * in_range;
  SampledFrames out;
  if (spec.fps) {
    const double fps = *spec.fps;
    LVX_CHECK(fps > 0 && std::isfinite(fps), "sampling: fps must be > 0, got ", fps);
    const double count = (end - start) * fps;
    LVX_CHECK(spec.max_frames <= 0 || count <= static_cast<double>(spec.max_frames),
              "sampling: fps ", fps, " over [", start, ", ", end, ") s asks for about ",
              static_cast<int64_t>(std::ceil(count)), " frames, over the limit of ",
              spec.max_frames, " (--max-frames): lower the fps or the range");
    LVX_CHECK(count <= static_cast<double>(most), "sampling: fps ", fps, " over [", start, ", ",
              end, ") s asks for about ", count, " frames, but the range holds ", in_range,
              " frame", in_range == 1 ? "" : "s", " (at most ", kMaxSamplesPerFrame,
              " samples per frame, ", most, "): lower the fps");
    for (int64_t k = 0;; ++k) {
      const double t = start + static_cast<double>(k) / fps;
      // With slack: start + k / fps written in doubles must not reach a frame at the end.
      if (t >= end - kTimeEpsilon) break;
      // Before the first frame nothing is shown yet; the first frame is the closest answer.
      out.indices.push_back(std::max<int64_t>(0, played_at(tl, t)));
      out.times.push_back(t);
    }
    return out;
  }
  const int64_t n = *spec.num_frames;
  LVX_CHECK(n >= 1, "sampling: num_frames must be >= 1, got ", n);
  LVX_CHECK(spec.max_frames <= 0 || n <= spec.max_frames, "sampling: num_frames ", n,
            " is over the limit of ", spec.max_frames, " (--max-frames)");
  // last: the last frame whose pts < end (one before the first frame with pts >= end).
  LVX_CHECK(last >= first, "sampling: no frame starts in [", start, ", ", end, ") s");
  LVX_CHECK(n <= most, "sampling: num_frames ", n, " is more than the range [", start, ", ", end,
            ") s can give: it holds ", in_range, " frame", in_range == 1 ? "" : "s", " (at most ",
            kMaxSamplesPerFrame, " samples per frame, ", most, ")");
  for (int64_t k = 0; k < n; ++k) {
    const int64_t idx = n == 1 ? first : first + round_div_half_even(k * (last - first), n - 1);
    out.indices.push_back(idx);
    out.times.push_back(tl.pts[idx]);
  }
  return out;
}

std::vector<int64_t> shard_positions(int64_t count, const ShardSpec& shard) {
  LVX_CHECK(shard.world >= 1, "shard: world size must be >= 1, got ", shard.world);
  LVX_CHECK(shard.rank >= 0 && shard.rank < shard.world, "shard: rank must be in [0, ", shard.world,
            "), got ", shard.rank);
  LVX_CHECK(count >= 0, "shard: count must be >= 0, got ", count);
  std::vector<int64_t> out;
  for (int64_t p = shard.rank; p < count; p += shard.world) out.push_back(p);
  return out;
}

}  // namespace lvx::video
