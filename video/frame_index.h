// The frame index of one video stream, built by reading every packet once (no decoding): the pts
// of every frame in presentation order and which frames are keyframes. It comes from the stream
// itself, never from container metadata, which is wrong for variable frame rate and for files
// whose header lies about nb_frames (decord #373). Exact seeking and the content-derived frame
// count both rest on it. Memory: 9 bytes per frame (an hour at 30 fps ≈ 1 MB).
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
  std::vector<uint8_t> keyframe;  // 1 when frame i can start decoding
  int64_t end_pts = 0;            // pts of the last frame + its duration (the stream's end)
  // Set when reading stopped on an error other than end of file (a truncated or damaged
  // container): the frames listed are those whose packets could be read.
  bool truncated = false;
  std::string truncation_reason;

  int64_t num_frames() const { return static_cast<int64_t>(pts.size()); }
  double pts_seconds(int64_t i) const { return pts_to_seconds(pts[i], time_base); }
  double end_seconds() const { return pts_to_seconds(end_pts, time_base); }
  // Index of the keyframe from which decoding must start to produce frame i (largest keyframe
  // index ≤ i); 0 when no keyframe precedes i.
  int64_t keyframe_before(int64_t i) const;
  // Frame whose pts equals `p` exactly, or -1.
  int64_t find_pts(int64_t p) const;
  // The sampler's view: pts in seconds and the end time.
  Timeline timeline() const;
};

// Reads every packet of `stream_index` from the current position (call right after opening)
// and builds the index. Leaves the demuxer at the end; the caller seeks back. `path` is only
// used in error messages. Throws when the stream has no frames at all.
FrameIndex scan_frame_index(AVFormatContext* fmt, int stream_index, const std::string& path);

}  // namespace lvx::video
