// Which frames to take: pure functions from a video's timeline (pts of every frame) and a
// SampleSpec to frame indices, and the rank sharding of those indices. No FFmpeg here, so every
// rule is testable on hand-written timelines. The rules (docs/video.md):
//
//   played_at(t)  = the frame shown at time t: the largest i with pts[i] <= t (pts[i+1] > t),
//                   i.e. frame i is visible on [pts[i], pts[i+1]) and the last on [pts[n-1], end).
//   Range         = [start, end), start defaulting to pts[0] and end to the stream end; an end
//                   past the stream end is clamped to it (never a frame that does not exist).
//   fps mode      = timestamps t_k = start + k / fps for k = 0, 1, ... while t_k < end (1 ns of
//                   slack, so a 12 s video at 1 fps gives 12 timestamps, not 13);
//                   index_k = played_at(t_k). Duplicates appear when fps exceeds the source rate.
//   uniform N     = first = played_at(start), last = the last frame with pts < end;
//                   index_k = first + round(k * (last - first) / (N - 1)), k = 0..N-1, computed in
//                   exact integer arithmetic and rounded half to even (as torch.linspace(...)
//                   .round() in qwen-vl-utils); N = 1 gives first. Both ends are always included.
//   Shard         = rank r of n takes the sampled positions r, r + n, r + 2n, … (striped): sizes
//                   differ by at most one, the union is exactly all M, and the split is the
//                   model's key layout (models::media_layout, whole images striped across the
//                   ranks), so rank r decodes exactly the frames whose visual tokens it holds.
//                   Striped and not contiguous so that every rank's frames are seen by about as
//                   many text tokens (models/parallel.h).
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "video/video_options.h"

namespace lvx::video {

// A video's frame times in seconds: pts ascending (presentation order), end = end of last frame.
// The decoder gives player time (frame 0 at 0, FrameIndex::timeline); any origin works here.
struct Timeline {
  std::vector<double> pts;
  double end = 0;
};

// Comparisons of a timestamp against a pts allow this much (seconds), so that a timestamp
// computed as k / fps lands on the frame whose pts is the same instant written in another
// time base (e.g. 1/30 s vs 512/15360 s).
constexpr double kTimeEpsilon = 1e-9;

// Frame shown at time t, or -1 when t < pts[0] - eps or t >= end.
int64_t played_at(const Timeline& tl, double t);

struct SampledFrames {
  std::vector<int64_t> indices;  // frame indices, non-decreasing
  std::vector<double> times;     // the requested timestamp (fps mode) or the frame's pts (uniform)
};

// Applies the rules above. Throws lvx::Error for an invalid spec (both or neither of fps and
// num_frames, fps <= 0, N < 1, start >= end, start past the stream end, an empty range), and,
// before allocating, for more samples than kMaxSamplesPerFrame per frame of the range.
SampledFrames sample_frames(const Timeline& tl, const SampleSpec& spec);

// The positions (ascending) of `count` sampled frames that rank `shard.rank` of `shard.world`
// takes: shard.rank, shard.rank + shard.world, …
std::vector<int64_t> shard_positions(int64_t count, const ShardSpec& shard);

// round(num / den) for num >= 0, den > 0, ties to even (exact; no floating point).
int64_t round_div_half_even(int64_t num, int64_t den);

}  // namespace lvx::video
