// Exact seeking decoder (see decoder.h). Colour: swscale converts with the matrix and range the
// frame carries; an unspecified matrix means BT.601, which is what FFmpeg (and so the ffmpeg CLI)
// assumes, so CPU output matches `ffmpeg -pix_fmt rgb24` bit for bit with the same sws flags.
#include "video/decoder.h"

extern "C" {
#include <libavutil/display.h>
#include <libavutil/pixdesc.h>
}

#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <opencv2/core.hpp>

#include "video/index_cache.h"

namespace lvx::video {
namespace {

// Chroma is interpolated (not replicated) and rounding is exact: the same flags go to the ffmpeg
// CLI in the tests (-vf scale=flags=bicubic+accurate_rnd+full_chroma_int).
constexpr int kSwsFlags = SWS_BICUBIC | SWS_ACCURATE_RND | SWS_FULL_CHR_H_INT;

// Clockwise degrees to apply so the frame shows as a player shows it (what ffmpeg's autorotate
// does with the display matrix), rounded to a multiple of 90.
int rotation_from_display_matrix(const AVStream* st) {
  size_t size = 0;
  const uint8_t* data = av_stream_get_side_data(st, AV_PKT_DATA_DISPLAYMATRIX, &size);
  if (!data || size < 9 * sizeof(int32_t)) return 0;
  const double ccw = av_display_rotation_get(reinterpret_cast<const int32_t*>(data));
  if (std::isnan(ccw)) return 0;
  int cw = static_cast<int>(std::lround(-ccw / 90.0)) * 90;
  cw %= 360;
  return cw < 0 ? cw + 360 : cw;
}

bool is_full_range_format(AVPixelFormat f) {
  return f == AV_PIX_FMT_YUVJ420P || f == AV_PIX_FMT_YUVJ422P || f == AV_PIX_FMT_YUVJ444P ||
         f == AV_PIX_FMT_YUVJ440P || f == AV_PIX_FMT_YUVJ411P;
}

std::string or_unknown(const char* s) { return s ? s : "unknown"; }

// A regular, non-empty file, said before FFmpeg opens it. stat(), not std::filesystem: libtorch.so
// exports its own, broken, std::filesystem symbols.
void check_regular_file(const std::string& path) {
  struct stat st_buf {};
  LVX_CHECK(::stat(path.c_str(), &st_buf) == 0, "video '", path, "': no such file");
  LVX_CHECK(!S_ISDIR(st_buf.st_mode), "video '", path, "': is a directory, not a video file");
  // A FIFO or a device would block FFmpeg's open or never end: only regular files are videos.
  LVX_CHECK(S_ISREG(st_buf.st_mode), "video '", path, "': is ",
            S_ISFIFO(st_buf.st_mode) ? "a FIFO" : "not a regular file (a device or a socket)",
            ", not a video file");
  LVX_CHECK(st_buf.st_size > 0, "video '", path, "': the file is empty");
}

// The index of the file's best video stream, and its decoder in *codec; an audio-only file, cover
// art or a codec FFmpeg cannot decode is refused, saying which.
int select_video_stream(AVFormatContext* fmt, const std::string& path, const AVCodec** codec) {
  int stream = av_find_best_stream(fmt, AVMEDIA_TYPE_VIDEO, -1, -1, codec, 0);
  if (stream >= 0 && (fmt->streams[stream]->disposition & AV_DISPOSITION_ATTACHED_PIC))
    stream = AVERROR_STREAM_NOT_FOUND;  // cover art of an audio file is not a video
  if (stream == AVERROR_STREAM_NOT_FOUND) {
    int audio = 0;
    for (unsigned s = 0; s < fmt->nb_streams; ++s)
      audio += fmt->streams[s]->codecpar->codec_type == AVMEDIA_TYPE_AUDIO;
    LVX_FAIL("video '", path, "': no video stream (", fmt->nb_streams, " streams, ", audio,
             " audio", audio > 0 ? ": an audio-only file" : "", ")");
  }
  if (stream == AVERROR_DECODER_NOT_FOUND)
    LVX_FAIL("video '", path, "': FFmpeg has no decoder for its video codec");
  LVX_AV_CHECK(stream, "video '", path, "': cannot select a video stream");
  return stream;
}

// The stream's decoder, opened with `threads` threads (0: FFmpeg's choice) of frame and slice
// threading.
UniqueAVCodecContext open_decoder(const AVCodec* codec, const AVStream* st, int threads,
                                  const std::string& path) {
  UniqueAVCodecContext ctx(avcodec_alloc_context3(codec));
  LVX_CHECK(ctx != nullptr, "avcodec_alloc_context3: out of memory");
  LVX_AV_CHECK(avcodec_parameters_to_context(ctx.get(), st->codecpar), "video '", path,
               "': bad codec parameters");
  ctx->thread_count = threads;
  ctx->thread_type = FF_THREAD_FRAME | FF_THREAD_SLICE;
  ctx->pkt_timebase = st->time_base;
  LVX_AV_CHECK(avcodec_open2(ctx.get(), codec, nullptr), "video '", path, "': cannot open the ",
               codec->name, " decoder");
  return ctx;
}

// What the stream's header says, into `info` (whose path names the file in errors): the frame
// size, bounded; rotation; pixel format and colour; frames and duration, for comparison.
void read_header_info(const AVFormatContext* fmt, const AVStream* st, const DecodeOptions& options,
                      VideoInfo& info) {
  const std::string& path = info.path;
  info.coded_width = st->codecpar->width;
  info.coded_height = st->codecpar->height;
  LVX_CHECK(info.coded_width > 0 && info.coded_height > 0, "video '", path,
            "': the video stream has no frame size (", info.coded_width, "x", info.coded_height,
            ")");
  // Bounded before a frame is decoded: a 1 MB image can declare 16000 x 16000 pixels.
  LVX_CHECK(int64_t{info.coded_width} * info.coded_height <= options.max_frame_pixels, "video '",
            path, "': frames of ", info.coded_width, "x", info.coded_height,
            " pixels exceed the limit of ", options.max_frame_pixels, " pixels per frame");
  info.rotation = rotation_from_display_matrix(st);
  const bool swap = info.rotation == 90 || info.rotation == 270;
  info.width = swap ? info.coded_height : info.coded_width;
  info.height = swap ? info.coded_width : info.coded_height;
  info.pixel_format =
      or_unknown(av_get_pix_fmt_name(static_cast<AVPixelFormat>(st->codecpar->format)));
  info.color_space = or_unknown(av_color_space_name(st->codecpar->color_space));
  info.color_range = or_unknown(av_color_range_name(st->codecpar->color_range));
  info.num_frames_from_header = st->nb_frames;
  if (st->duration != AV_NOPTS_VALUE)
    info.duration_seconds_from_header = pts_to_seconds(st->duration, st->time_base);
  else if (fmt->duration != AV_NOPTS_VALUE)
    info.duration_seconds_from_header = fmt->duration / static_cast<double>(AV_TIME_BASE);
}

// What the frame index says (frames, begin, end, duration, average rate) into `info`.
void read_index_info(const FrameIndex& index, bool from_cache, VideoInfo& info) {
  info.index_from_cache = from_cache;
  info.end_from_container = index.end_from_container;
  info.num_frames = index.num_frames();
  info.begin_seconds = index.pts_seconds(0);
  info.end_seconds = index.end_seconds();
  info.duration_seconds = index.duration_seconds();
  info.average_fps = info.duration_seconds > 0 ? info.num_frames / info.duration_seconds : 0;
}

}  // namespace

VideoDecoder::VideoDecoder(const std::string& path, const DecodeOptions& options)
    : options_(options) {
  LVX_CHECK(options.threads >= 0 && options.threads <= kMaxDecodeThreads,
            "decoder threads must be in [0, ", kMaxDecodeThreads, "] (0 = FFmpeg auto), got ",
            options.threads);
  // FFmpeg's own warnings ("partial file", alignment notes) would interleave with ours; every
  // problem that matters reaches the caller as an lvx::Error or a DecodeReport entry instead.
  av_log_set_level(AV_LOG_FATAL);
  check_regular_file(path);
  fmt_ = open_input(path);
  const AVCodec* codec = nullptr;
  stream_ = select_video_stream(fmt_.get(), path, &codec);
  AVStream* st = fmt_->streams[stream_];
  codec_ = open_decoder(codec, st, options.threads, path);
  packet_ = make_av_packet();
  frame_ = make_av_frame();

  info_.path = path;
  info_.codec = codec->name;
  read_header_info(fmt_.get(), st, options, info_);

  bool from_cache = false;
  index_ = load_or_scan_frame_index(fmt_.get(), stream_, path, options.index_cache, &from_cache);
  stats_.packets_scanned = from_cache ? 0 : index_.num_frames();
  read_index_info(index_, from_cache, info_);
}

void VideoDecoder::reset_decoder() {
  avcodec_flush_buffers(codec_.get());
  flushed_ = false;
  has_pending_ = false;
  if (has_held_) av_packet_unref(packet_.get());
  has_held_ = false;
  cursor_ = -1;
}

bool VideoDecoder::seek_and_check(int64_t ts, int flags, int64_t k) {
  reset_decoder();
  ++stats_.seeks;
  if (av_seek_frame(fmt_.get(), (flags & AVSEEK_FLAG_BYTE) ? -1 : stream_, ts, flags) < 0)
    return false;
  while (true) {
    if (av_read_frame(fmt_.get(), packet_.get()) < 0) return false;
    if (packet_->stream_index == stream_) break;
    av_packet_unref(packet_.get());
  }
  has_held_ = true;
  // Compare file positions when both are known (every demuxer here sets them), else decode
  // timestamps: a packet at or before the keyframe's means the keyframe is still to come.
  if (index_.pos[k] >= 0 && packet_->pos >= 0) return packet_->pos <= index_.pos[k];
  if (index_.dts[k] != AV_NOPTS_VALUE && packet_->dts != AV_NOPTS_VALUE)
    return packet_->dts <= index_.dts[k];
  return true;  // nothing to compare: decode_frame catches a frame that never comes out
}

void VideoDecoder::seek_to_keyframe_for(int64_t i) {
  // Demuxers seek by different clocks: mov and matroska by presentation time (the keyframe's
  // pts lands on it; its dts would land a whole GOP early in mp4 with B-frames), MPEG-TS/PS by
  // decode time with a binary search (the pts lands after the keyframe when B-frames delay it),
  // some only approximately. So try the cheapest target first, check where the seek landed
  // against the keyframe packet's file position, and step back until it is at or before it.
  const int64_t k = index_.keyframe_before(i);
  origin_ = k;
  const int64_t pts = index_.pts[k];
  const int64_t dts = index_.dts[k] != AV_NOPTS_VALUE ? std::min(index_.dts[k], pts) : pts;
  // Once the pts target has landed late and the dts one has not, this demuxer seeks by dts:
  // go there directly from then on (one seek per GOP instead of two).
  if (!seek_by_dts_ && seek_and_check(pts, AVSEEK_FLAG_BACKWARD, k)) return;
  if (!seek_by_dts_) ++stats_.reseeks;
  if (dts < pts && seek_and_check(dts, AVSEEK_FLAG_BACKWARD, k)) {
    seek_by_dts_ = true;
    return;
  }
  if (seek_by_dts_) {  // the dts target landed late too: the steps back below
    ++stats_.reseeks;
    if (seek_and_check(pts, AVSEEK_FLAG_BACKWARD, k)) return;
  }
  const int64_t second = std::max<int64_t>(1, av_rescale_q(1, AVRational{1, 1}, index_.time_base));
  const int64_t earliest =
      index_.dts[0] != AV_NOPTS_VALUE ? std::min(index_.dts[0], index_.pts[0]) : index_.pts[0];
  for (int64_t back = second; dts - back > earliest; back *= 4)
    if (seek_and_check(dts - back, AVSEEK_FLAG_BACKWARD, k)) return;
  if (seek_and_check(earliest, AVSEEK_FLAG_BACKWARD, k)) return;
  // Last resort: the first byte of the file, for demuxers whose timestamp seek cannot get back
  // to the start; those that cannot seek by bytes get a target before every timestamp.
  if (!(fmt_->iformat->flags & AVFMT_NO_BYTE_SEEK) && seek_and_check(0, AVSEEK_FLAG_BYTE, k))
    return;
  seek_and_check(earliest - 1000 * second, AVSEEK_FLAG_BACKWARD, k);
}

bool VideoDecoder::next_decoded_frame(AVFrame* frame) {
  if (has_pending_) {
    has_pending_ = false;
    return true;  // frame_ still holds it
  }
  av_frame_unref(frame);
  while (true) {
    const int r = avcodec_receive_frame(codec_.get(), frame);
    if (r >= 0) {
      ++stats_.frames_decoded;
      return true;
    }
    if (r == AVERROR_EOF) return false;
    if (r != AVERROR(EAGAIN)) {
      ++stats_.decode_errors;
      continue;
    }
    if (flushed_) return false;
    const int status = has_held_ ? 0 : av_read_frame(fmt_.get(), packet_.get());
    has_held_ = false;
    if (status < 0) {  // end of file, or a read error past which nothing more can come
      LVX_AV_CHECK(avcodec_send_packet(codec_.get(), nullptr), "video '", info_.path,
                   "': cannot flush the decoder");
      flushed_ = true;
      continue;
    }
    PacketUnref unref(packet_.get());
    if (packet_->stream_index != stream_) continue;
    ++stats_.packets_read;
    const int s = avcodec_send_packet(codec_.get(), packet_.get());
    if (s < 0 && s != AVERROR(EAGAIN)) ++stats_.decode_errors;
  }
}

bool VideoDecoder::decode_frame(int64_t i, DecodedFrame* out, std::string* why) {
  LVX_CHECK(i >= 0 && i < index_.num_frames(), "video '", info_.path, "': frame index ", i,
            " out of range [0, ", index_.num_frames(), ")");
  const bool can_continue = cursor_ >= 0 && cursor_ <= i && index_.keyframe_before(i) <= cursor_;
  if (!can_continue) seek_to_keyframe_for(i);
  bool retried = false;
  const int64_t target = index_.pts[i];
  // Frame i did not come out after a seek to its keyframe: some decoders need what precedes an
  // open-GOP keyframe (a flushed H.264 decoder dropped the frame after the last non-IDR I that
  // a continuous decode gives; torchcodec #179 saw seeks land late in HEVC/mkv). Try once more
  // from the keyframe before that one, then from the start of the stream, as FFmpeg's own
  // full decode produces it.
  int retries = 0;
  auto retry_from_earlier = [&] {
    ++stats_.fallback_seeks;
    const int64_t from = retries == 0 && origin_ > 0 ? origin_ - 1 : 0;
    seek_to_keyframe_for(from);
    retried = retries == 1 || origin_ == 0;
    ++retries;
  };
  while (true) {
    if (!next_decoded_frame(frame_.get())) {
      if (!retried && origin_ > 0) {
        retry_from_earlier();
        continue;
      }
      cursor_ = -1;
      *why = "the decoder produced no frame with its pts before the stream ended";
      return false;
    }
    int64_t ts = frame_->best_effort_timestamp;
    // A frame with no timestamp at all (MPEG-2 in a program stream: the last reference frame,
    // flushed at the end, comes with neither pts nor dts) is the frame after the one before it
    // in display order, where the index placed it (fill_missing_pts; the ffmpeg CLI extrapolates
    // it the same way). Unknown position: it cannot be placed, and is passed over.
    if (ts == AV_NOPTS_VALUE && cursor_ >= 0 && cursor_ < static_cast<int64_t>(index_.pts.size()))
      ts = index_.pts[cursor_];
    const int64_t idx = index_.find_pts(ts);
    if (ts > target) {
      if (!retried && origin_ > 0) {
        retry_from_earlier();
        continue;
      }
      // Frame i never came out: its data is damaged. Keep this later frame for the next call.
      has_pending_ = true;
      cursor_ = idx >= 0 ? idx : -1;
      *why = "the decoder did not produce it (damaged data)";
      return false;
    }
    if (idx < 0) continue;  // a frame the index does not know (e.g. from a damaged packet)
    cursor_ = idx + 1;
    if (idx < i) continue;
    if ((frame_->flags & AV_FRAME_FLAG_CORRUPT) || frame_->decode_error_flags) {
      *why = "the decoder flagged it as corrupt";
      return false;
    }
    out->index = i;
    out->pts_seconds = index_.pts_seconds(i);
    out->time_seconds = index_.time_seconds(i);
    convert(frame_.get(), out);
    return true;
  }
}

void VideoDecoder::convert(const AVFrame* frame, DecodedFrame* out) {
  const auto src = static_cast<AVPixelFormat>(frame->format);
  const int w = static_cast<int>(info_.coded_width), h = static_cast<int>(info_.coded_height);
  // Always to the stream's size, so a mid-stream size change still gives one frame shape.
  SwsContext* ctx = sws_getCachedContext(sws_.release(), frame->width, frame->height, src, w, h,
                                         AV_PIX_FMT_RGB24, kSwsFlags, nullptr, nullptr, nullptr);
  sws_.reset(ctx);
  LVX_CHECK(ctx != nullptr, "video '", info_.path, "': swscale cannot convert ",
            or_unknown(av_get_pix_fmt_name(src)), " ", frame->width, "x", frame->height,
            " to rgb24");
  const AVPixFmtDescriptor* desc = av_pix_fmt_desc_get(src);
  const bool details_changed = ctx != sws_details_ctx_ || frame->colorspace != sws_colorspace_ ||
                               frame->color_range != sws_range_;
  if (details_changed && desc && !(desc->flags & AV_PIX_FMT_FLAG_RGB)) {
    sws_details_ctx_ = ctx;
    sws_colorspace_ = frame->colorspace;
    sws_range_ = frame->color_range;
    const int full = frame->color_range == AVCOL_RANGE_JPEG || is_full_range_format(src);
    // sws_getCoefficients maps AVColorSpace values (they equal SWS_CS_*) and falls back to
    // BT.601 for unspecified/unknown ones, like FFmpeg's scale filter.
    sws_setColorspaceDetails(ctx, sws_getCoefficients(frame->colorspace), full,
                             sws_getCoefficients(SWS_CS_DEFAULT), 1, 0, 1 << 16, 1 << 16);
  }
  cv::Mat rgb(h, w, CV_8UC3);
  uint8_t* dst[4] = {rgb.data, nullptr, nullptr, nullptr};
  int dst_stride[4] = {static_cast<int>(rgb.step[0]), 0, 0, 0};
  const int rows = sws_scale(ctx, frame->data, frame->linesize, 0, frame->height, dst, dst_stride);
  LVX_CHECK(rows == h, "video '", info_.path, "': swscale wrote ", rows, " rows, expected ", h);
  switch (info_.rotation) {
    case 90:
      cv::rotate(rgb, out->rgb, cv::ROTATE_90_CLOCKWISE);
      break;
    case 180:
      cv::rotate(rgb, out->rgb, cv::ROTATE_180);
      break;
    case 270:
      cv::rotate(rgb, out->rgb, cv::ROTATE_90_COUNTERCLOCKWISE);
      break;
    default:
      out->rgb = rgb;
  }
}

}  // namespace lvx::video
