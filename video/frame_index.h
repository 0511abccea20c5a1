// The frame index of one video stream, built by reading every packet once (no decoding): the pts
// of every frame in presentation order, which frames are keyframes, and where each frame's
// packet lies (dts, byte position) so a seek can be checked. It comes from the stream itself,
// never from the container's frame count, which is wrong for variable frame rate and for files
// whose header lies about nb_frames (decord #373). Exact seeking and the content-derived frame
// count both rest on it. Memory: 25 bytes per frame (an hour at 30 fps ≈ 2.7 MB). Built once per
// video and shared between ranks and runs through the index cache (index_cache.h).
//
// Time 0 is the first displayed frame (the smallest pts), as players, subtitles and benchmark
// annotations count it, whatever the stream's own start (B-frame delay, MPEG-TS clock, edit
// lists). The stream's own pts are kept alongside.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "video/ffmpeg_common.h"
#include "video/sampler.h"

namespace lvx::video {

struct FrameIndex {
  AVRational time_base{1, 1};
  // One entry per frame, sorted by pts (presentation order). Index i is "frame i".
  std::vector<int64_t> pts;       // stream time base; the packet's pts, or its dts when unset
  std::vector<int64_t> dts;       // the frame's packet dts; AV_NOPTS_VALUE when unknown
  std::vector<int64_t> pos;       // the frame's packet byte offset in the file; -1 when unknown
  std::vector<uint8_t> keyframe;  // 1 when frame i can start decoding
  // Where the last frame stops being shown (stream time base): the container's stated duration
  // when it is present and consistent with the frames, else the last pts + its duration.
  int64_t end_pts = 0;
  bool end_from_container = false;  // which of the two end_pts is
  // Set when reading stopped on an error other than end of file, or the frames end well before
  // the container's stated duration (a truncated or damaged container): the frames listed are
  // those whose packets could be read.
  bool truncated = false;
  std::string truncation_reason;

  int64_t num_frames() const { return static_cast<int64_t>(pts.size()); }
  // The stream's own pts of frame i, in seconds.
  double pts_seconds(int64_t i) const { return pts_to_seconds(pts[i], time_base); }
  double end_seconds() const { return pts_to_seconds(end_pts, time_base); }
  // Player time of frame i: seconds since the first displayed frame (frame 0 is at 0).
  double time_seconds(int64_t i) const { return pts_to_seconds(pts[i] - pts[0], time_base); }
  // Player time at which the video ends.
  double duration_seconds() const { return pts_to_seconds(end_pts - pts[0], time_base); }
  // Index of the keyframe from which decoding must start to produce frame i (largest keyframe
  // index ≤ i); 0 when no keyframe precedes i.
  int64_t keyframe_before(int64_t i) const;
  // Frame whose pts equals `p` exactly, or -1.
  int64_t find_pts(int64_t p) const;
  // The sampler's view, in player time: frame i at time_seconds(i), end at duration_seconds().
  Timeline timeline() const;
};

// Reads every packet of `stream_index` from the current position (call right after opening)
// and builds the index, including the end and the truncation check against the container's
// stated duration. Leaves the demuxer at the end; the caller seeks back. `path` is only used in
// error messages. Throws when the stream has no frames at all.
FrameIndex scan_frame_index(AVFormatContext* fmt, int stream_index, const std::string& path);

}  // namespace lvx::video
