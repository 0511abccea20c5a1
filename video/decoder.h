// VideoDecoder: exact, seekable decoding of one video stream to RGB24 frames as a player shows
// them. Opening scans the packets once (frame_index.h); frame i is then decoded by seeking to the
// keyframe that precedes it in the index and decoding forward, never from the start of the file.
// Frames come out converted with swscale honouring the stream's colour matrix (BT.601/709/2020)
// and range (limited/full), and rotated by the display matrix (docs/video.md).
#pragma once

#include <cstdint>
#include <functional>
#include <opencv2/core.hpp>
#include <string>
#include <vector>

#include "video/ffmpeg_common.h"
#include "video/frame_index.h"
#include "video/video_options.h"

namespace lvx::video {

// ======================== METADATA ========================
struct VideoInfo {
  std::string path;
  std::string codec;         // e.g. "h264", "hevc", "vp9"
  std::string pixel_format;  // decoder output, e.g. "yuv420p10le"
  std::string color_space;   // e.g. "bt709", "unknown" (→ BT.601, as FFmpeg's own default)
  std::string color_range;   // "tv" (limited), "pc" (full) or "unknown"
  int64_t coded_width = 0, coded_height = 0;  // as stored, before rotation
  int64_t width = 0, height = 0;              // as displayed, after rotation
  int rotation = 0;  // clockwise degrees applied to show the frame: 0, 90, 180 or 270
  // From the content (the frame index). Player time 0 is the first displayed frame, whose
  // stream pts is begin_seconds; the video ends at end_seconds (stream pts) = duration_seconds
  // (player time): where the last frame stops being shown (docs/video.md).
  int64_t num_frames = 0;
  double begin_seconds = 0, end_seconds = 0;  // stream pts of the first frame and of the end
  double duration_seconds = 0;                // end - begin
  double average_fps = 0;                     // num_frames / duration
  bool end_from_container = false;  // the end is the container's stated duration (not a guess)
  bool index_from_cache = false;    // the frame index was read from the index cache
  // From the container header, for comparison only (may be absent = 0, or wrong):
  int64_t num_frames_from_header = 0;
  double duration_seconds_from_header = 0;
};

// One decoded frame: RGB24, H×W×3 (displayed orientation), its index, its stream pts and its
// player time (seconds since the first displayed frame) in seconds.
struct DecodedFrame {
  int64_t index = -1;
  double pts_seconds = 0;
  double time_seconds = 0;
  cv::Mat rgb;  // CV_8UC3, continuous, owned
};

// Counters for tests and benchmarks: proof that a few frames from an hour decode a few GOPs.
struct DecodeStats {
  int64_t packets_read = 0;     // after the index scan
  int64_t packets_scanned = 0;  // by the index scan (read, not decoded); 0 from the cache
  int64_t frames_decoded = 0;   // frames that came out of the decoder
  int64_t seeks = 0;            // seeks to a keyframe
  int64_t reseeks = 0;          // a seek that landed after its keyframe, retried earlier
  int64_t fallback_seeks = 0;   // a frame that never came out after a seek, retried from the start
  int64_t decode_errors = 0;    // packets or frames the decoder rejected
};

class VideoDecoder {
 public:
  // ======================== CONSTRUCTION ========================
  // Opens `path`, picks its best video stream, scans it and opens the decoder. Throws
  // lvx::Error naming the file for a missing file, a non-video file, an audio-only file, an
  // unsupported codec, or a stream with no readable frame.
  VideoDecoder(const std::string& path, const DecodeOptions& options = {});
  VideoDecoder(const VideoDecoder&) = delete;
  VideoDecoder& operator=(const VideoDecoder&) = delete;

  // ======================== METADATA QUERY ========================
  const VideoInfo& info() const { return info_; }
  const FrameIndex& index() const { return index_; }
  const DecodeStats& stats() const { return stats_; }

  // ======================== DECODING AND SEEKING ========================
  // Decodes frame `i` (0 <= i < num_frames), seeking only when decoding forward from the
  // current position would cost more than starting at the keyframe before `i`. Returns false
  // when frame i cannot be produced (decoder error, frame flagged corrupt, or its packet is
  // missing) and puts the reason in *why; the caller applies its CorruptPolicy. Calls in
  // increasing order of i decode each needed GOP once.
  bool decode_frame(int64_t i, DecodedFrame* out, std::string* why);

 private:
  void seek_to_keyframe_for(int64_t i);
  // Seeks to `ts` (stream time base; AVSEEK_FLAG_BYTE: a byte offset) and reads this stream's
  // first packet into packet_ (held for the decoder). True when it lies at or before keyframe
  // k's packet in the file, i.e. decoding from there produces frame k.
  bool seek_and_check(int64_t ts, int flags, int64_t k);
  void reset_decoder();
  // Next frame out of the decoder, feeding packets as needed; false at the end of the stream.
  bool next_decoded_frame(AVFrame* frame);
  void convert(const AVFrame* frame, DecodedFrame* out);

  // ======================== ATTRIBUTES ========================
  DecodeOptions options_;
  VideoInfo info_;
  FrameIndex index_;
  UniqueAVFormatContext fmt_;
  UniqueAVCodecContext codec_;
  UniqueSwsContext sws_;
  // The colour details last given to sws_ (they are set again only when they change).
  const SwsContext* sws_details_ctx_ = nullptr;
  AVColorSpace sws_colorspace_ = AVCOL_SPC_UNSPECIFIED;
  AVColorRange sws_range_ = AVCOL_RANGE_UNSPECIFIED;
  UniqueAVPacket packet_;
  UniqueAVFrame frame_;
  int stream_ = -1;
  int64_t cursor_ = -1;       // index of the next frame the decoder will output; -1: unknown
  bool flushed_ = false;      // end of stream sent to the decoder
  bool has_pending_ = false;  // frame_ holds a decoded frame not yet consumed
  bool has_held_ = false;     // packet_ holds a read packet not yet sent to the decoder
  bool seek_by_dts_ = false;
  int64_t origin_ = -1;  // the keyframe the decoder last started from  // this demuxer's seeks land
                         // on keyframes by their dts
  DecodeStats stats_;
};

}  // namespace lvx::video
