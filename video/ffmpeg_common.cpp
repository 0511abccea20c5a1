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

// Media lvx opens are files of known containers: no protocol but file (a playlist, concat list
// or SDP description cannot reach other files or the network) and only these demuxers (not
// image2, whose patterns name other files; not hls, concat or sdp).
const char* const kDemuxers =
    "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,flv,mpegts,mpeg,mpegvideo,ogg,gif,h264,hevc,m4v,"
    "ivf,asf,yuv4mpegpipe,png_pipe,jpeg_pipe,webp_pipe,bmp_pipe,gif_pipe";

UniqueAVFormatContext open_input(const std::string& path) {
  AVFormatContext* raw = nullptr;
  AVDictionary* opts = nullptr;
  av_dict_set(&opts, "protocol_whitelist", "file", 0);
  av_dict_set(&opts, "format_whitelist", kDemuxers, 0);
  // FFmpeg frees *raw itself when avformat_open_input fails.
  const int status = avformat_open_input(&raw, path.c_str(), nullptr, &opts);
  av_dict_free(&opts);
  LVX_AV_CHECK(status, "video '", path, "': cannot open");
  UniqueAVFormatContext ctx(raw);
  LVX_AV_CHECK(avformat_find_stream_info(ctx.get(), nullptr), "video '", path,
               "': cannot read stream info");
  return ctx;
}

}  // namespace lvx::video
