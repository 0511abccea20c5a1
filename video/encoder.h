// VideoWriter: RGB24 frames → a video file with libavcodec/libavformat (the inverse of
// VideoDecoder, for synthetic data and tests). Frames are converted to yuv420p with swscale
// (BT.601 limited range, tagged as such in the stream, which is what VideoDecoder and the ffmpeg
// CLI assume for an untagged one too) and encoded at a constant frame rate: frame i has pts
// i / fps. The file is written as `path + ".partial"` and renamed to `path` by close(), so a run
// killed half way never leaves a truncated file under the real name.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <opencv2/core.hpp>
#include <string>

#include "video/ffmpeg_common.h"

namespace lvx::video {

struct WriterOptions {
  // libavcodec encoder name. "mpeg4" (MPEG-4 Part 2) is built into every libavcodec, needs no
  // external library and encodes tiny frames fast; "libx264" etc. work where FFmpeg has them.
  std::string codec = "mpeg4";
  // Frames between keyframes (the GOP size): the decoder seeks to a keyframe and decodes forward,
  // so a smaller interval makes random access cheaper and files bigger.
  int keyframe_interval = 12;
  // Constant quality, codec's quantizer scale (mpeg4: 1 best … 31 worst), used when bit_rate is 0.
  // 2 keeps flat colours within a few levels of the input after the yuv420p round trip.
  int quality = 2;
  // Target bits per second; 0 selects constant quality above.
  int64_t bit_rate = 0;
  // Encoder threads (1: many writers usually run side by side, one per worker).
  int threads = 1;
};

class VideoWriter {
 public:
  // Opens `path + ".partial"` for writing with the container guessed from `path`'s extension
  // (.mp4, .mkv, .avi, ...). width and height are in pixels and must be even (yuv420p halves
  // the chroma planes); fps is frames per second as a rational (e.g. {30000, 1001}). Throws
  // lvx::Error naming the path and FFmpeg's reason (unknown container, no such encoder, cannot
  // create the file).
  VideoWriter(const std::string& path, int width, int height, AVRational fps,
              const WriterOptions& options = {});
  VideoWriter(const std::string& path, int width, int height, int fps,
              const WriterOptions& options = {})
      : VideoWriter(path, width, height, AVRational{fps, 1}, options) {}
  // Without close() (an exception, an aborted run): the partial file is removed.
  ~VideoWriter();
  VideoWriter(const VideoWriter&) = delete;
  VideoWriter& operator=(const VideoWriter&) = delete;

  // Appends one frame: uint8 RGB [height, width, 3] on the CPU (any strides), or a CV_8UC3 Mat
  // in RGB channel order (not OpenCV's usual BGR). `keyframe` forces this frame to be coded on
  // its own (intra) besides the regular keyframe_interval: after a scene cut, a predicted frame
  // would carry faint traces of the previous scene in its quantized residual. Throws lvx::Error
  // naming the path on a wrong shape/type, after close(), or on an encoder error.
  void write(const at::Tensor& rgb, bool keyframe = false);
  void write(const cv::Mat& rgb, bool keyframe = false);

  // Flushes the encoder, writes the container trailer and renames the partial file to path().
  // Idempotent; errors name the path.
  void close();

  const std::string& path() const { return path_; }
  int64_t frames_written() const { return frames_; }

 private:
  struct OutputDeleter {
    void operator()(AVFormatContext* ctx) const;
  };
  void write_rgb(const uint8_t* data, int64_t row_stride, bool keyframe);
  // Sends `frame` (nullptr: flush) and muxes every packet the encoder has ready.
  void encode(AVFrame* frame);
  void release();  // frees FFmpeg state (closing the file) without renaming

  std::string path_, partial_;
  int width_ = 0, height_ = 0;
  int64_t frames_ = 0;
  bool closed_ = false;
  std::unique_ptr<AVFormatContext, OutputDeleter> fmt_;
  UniqueAVCodecContext codec_;
  UniqueSwsContext sws_;
  UniqueAVFrame frame_;
  UniqueAVPacket packet_;
  AVStream* stream_ = nullptr;  // owned by fmt_
};

}  // namespace lvx::video
