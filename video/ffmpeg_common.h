// FFmpeg plumbing shared by the video code: RAII owners for every libav* handle, FFmpeg's own
// error text, and one checking macro (LVX_AV_CHECK) that turns a negative status into lvx::Error.
// Written against FFmpeg 5.1 (Debian 12): libavformat 59, libavcodec 59, libswscale 6.
#pragma once

extern "C" {
#include <libavcodec/avcodec.h>
#include <libavformat/avformat.h>
#include <libavutil/avutil.h>
#include <libswscale/swscale.h>
}

#include <memory>
#include <string>

#include "src/common/error.h"

namespace lvx::video {

// Deleters for the two FFmpeg freeing conventions: f(T**) (sets the pointer to null) and f(T*).
template <typename T, void (*Fn)(T**)>
struct DeleterPP {
  void operator()(T* p) const {
    if (p) Fn(&p);
  }
};
template <typename T, void (*Fn)(T*)>
struct DeleterP {
  void operator()(T* p) const {
    if (p) Fn(p);
  }
};

using UniqueAVFormatContext =
    std::unique_ptr<AVFormatContext, DeleterPP<AVFormatContext, avformat_close_input>>;
using UniqueAVCodecContext =
    std::unique_ptr<AVCodecContext, DeleterPP<AVCodecContext, avcodec_free_context>>;
using UniqueAVFrame = std::unique_ptr<AVFrame, DeleterPP<AVFrame, av_frame_free>>;
using UniqueAVPacket = std::unique_ptr<AVPacket, DeleterPP<AVPacket, av_packet_free>>;
using UniqueSwsContext = std::unique_ptr<SwsContext, DeleterP<SwsContext, sws_freeContext>>;

// Unreferences a packet at the end of a read loop iteration, whatever path leaves it.
class PacketUnref {
 public:
  explicit PacketUnref(AVPacket* p) : p_(p) {}
  ~PacketUnref() { av_packet_unref(p_); }
  PacketUnref(const PacketUnref&) = delete;
  PacketUnref& operator=(const PacketUnref&) = delete;

 private:
  AVPacket* p_;
};

// FFmpeg's text for an error code (av_strerror), e.g. "Invalid data found when processing input".
std::string av_error_string(int status);

UniqueAVFrame make_av_frame();
UniqueAVPacket make_av_packet();

// Opens `path` and reads its stream info. Throws lvx::Error naming the file and FFmpeg's reason
// ("No such file or directory", "Invalid data found when processing input", ...). Only the file
// protocol and an allow-list of video and image demuxers (kDemuxers in ffmpeg_common.cpp): a
// playlist, concat list or SDP file is refused, never followed.
UniqueAVFormatContext open_input(const std::string& path);

// pts in stream time base → seconds.
inline double pts_to_seconds(int64_t pts, AVRational tb) { return pts * av_q2d(tb); }

}  // namespace lvx::video

// LVX_AV_CHECK(status_expr, "what was being done", ...): throws lvx::Error with the message, the
// FFmpeg error string and the source location when the status is negative. Evaluates once.
#define LVX_AV_CHECK(expr, ...)                                                                    \
  do {                                                                                             \
    const int lvx_av_status_ = (expr);                                                             \
    if (lvx_av_status_ < 0)                                                                        \
      throw ::lvx::Error(::lvx::str(__VA_ARGS__, ": ",                                             \
                                    ::lvx::video::av_error_string(lvx_av_status_), " (", __FILE__, \
                                    ":", __LINE__, ")"));                                          \
  } while (0)
