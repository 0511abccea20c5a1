// FFmpeg RAII helpers and error strings (see ffmpeg_common.h).
#include "video/ffmpeg_common.h"

namespace lvx::video {

std::string av_error_string(int status) {
  char buf[AV_ERROR_MAX_STRING_SIZE] = {0};
  if (av_strerror(status, buf, sizeof(buf)) < 0) return lvx::str("FFmpeg error ", status);
  return buf;
}

UniqueAVFrame make_av_frame() {
  UniqueAVFrame f(av_frame_alloc());
  LVX_CHECK(f != nullptr, "av_frame_alloc: out of memory");
  return f;
}

UniqueAVPacket make_av_packet() {
  UniqueAVPacket p(av_packet_alloc());
  LVX_CHECK(p != nullptr, "av_packet_alloc: out of memory");
  return p;
}

UniqueAVFormatContext open_input(const std::string& path) {
  AVFormatContext* raw = nullptr;
  // FFmpeg frees *raw itself when avformat_open_input fails.
  LVX_AV_CHECK(avformat_open_input(&raw, path.c_str(), nullptr, nullptr), "video '", path,
               "': cannot open");
  UniqueAVFormatContext ctx(raw);
  LVX_AV_CHECK(avformat_find_stream_info(ctx.get(), nullptr), "video '", path,
               "': cannot read stream info");
  return ctx;
}

}  // namespace lvx::video
