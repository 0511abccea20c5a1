// The whole per-rank video path: open and index the video, sample frame indices, keep this
// rank's share (video::shard_positions), decode them on a decoder thread through a bounded queue, and
// preprocess each into its slot of the output batch. Peak memory: the output batch, at most
// DecodeOptions::queue_capacity decoded RGB frames, one GOP of decoder state and the frame index
// (32 bytes per frame of the video) — independent of video length for a fixed number of frames.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "video/decoder.h"
#include "video/video_options.h"

namespace lvx::video {

// What happened beyond the happy path; empty events means every sampled frame decoded.
struct DecodeReport {
  std::vector<std::string> events;         // one line each: "frame 12 (pts 0.400 s): skipped: ..."
  int64_t skipped = 0;                     // frames dropped under CorruptPolicy::kSkip
  int64_t repeated = 0;                    // frames replaced under CorruptPolicy::kRepeat
  bool truncated = false;                  // the container ended early (see FrameIndex::truncated)
  int64_t sampled_total = 0;               // frames sampled over all ranks
  std::vector<int64_t> shard;              // this rank's positions in the sampled list
  DecodeStats stats;
};

struct FrameBatch {
  at::Tensor frames;   // [N, 3, H, W]: uint8 RGB, or float32 normalized (cfg.normalize)
  at::Tensor indices;  // int64 [N]: frame index in the video (presentation order)
  // float64 [N]: the frame's player time in seconds: 0 is the first displayed frame, as players,
  // subtitles and benchmark annotations count (SampleSpec start/end use the same clock).
  at::Tensor pts;
  at::Tensor stream_pts;  // float64 [N]: the frame's own pts in the stream, in seconds
  VideoInfo info;
  DecodeReport report;
};

// Samples `spec` over the video, keeps `shard`'s share, decodes and preprocesses it. Throws
// lvx::Error naming the file for bad input; a truncated container or a damaged sampled frame is
// an error under CorruptPolicy::kError and a report entry under kSkip / kRepeat.
FrameBatch decode_video(const std::string& path, const SampleSpec& spec, const ShardSpec& shard,
                        const PreprocessConfig& preprocess, const DecodeOptions& options = {});
// The same for explicit positions of the sampled list (ascending; each must exist): what a
// shard takes (shard_positions), or any other share (benchmarks/bench_video.cpp decodes a
// contiguous one to price the striped layout).
FrameBatch decode_positions(const std::string& path, const SampleSpec& spec,
                            const std::vector<int64_t>& positions,
                            const PreprocessConfig& preprocess, const DecodeOptions& options = {});

}  // namespace lvx::video
