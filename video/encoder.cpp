// Encoding RGB frames to a video file (see encoder.h). Plain libavcodec send/receive loop and
// libavformat muxing; every status goes through LVX_AV_CHECK so errors carry FFmpeg's text.
#include "video/encoder.h"

extern "C" {
#include <libavutil/imgutils.h>
#include <libavutil/opt.h>
}

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace lvx::video {

void VideoWriter::OutputDeleter::operator()(AVFormatContext* ctx) const {
  if (!ctx) return;
  if (ctx->oformat && !(ctx->oformat->flags & AVFMT_NOFILE)) avio_closep(&ctx->pb);
  avformat_free_context(ctx);
}

VideoWriter::VideoWriter(const std::string& path, int width, int height, AVRational fps,
                         const WriterOptions& options)
    : path_(path), partial_(path + ".partial"), width_(width), height_(height) {
  LVX_CHECK(width > 0 && height > 0 && width % 2 == 0 && height % 2 == 0, "video '", path,
            "': frame size must be positive and even (yuv420p), got ", width, "x", height);
  LVX_CHECK(fps.num > 0 && fps.den > 0, "video '", path, "': fps must be positive, got ", fps.num,
            "/", fps.den);
  LVX_CHECK(options.keyframe_interval >= 1, "video '", path,
            "': keyframe_interval must be >= 1, got ", options.keyframe_interval);
  LVX_CHECK(options.bit_rate > 0 || (options.quality >= 1 && options.quality <= 31), "video '",
            path, "': quality must be in [1, 31] when bit_rate is 0, got ", options.quality);
  // FFmpeg's muxer notes ("encoder did not produce proper pts", ...) would interleave with our
  // output; what matters reaches the caller as an lvx::Error.
  av_log_set_level(AV_LOG_FATAL);

  // The container comes from the real name: ".partial" is no extension FFmpeg knows.
  const AVOutputFormat* ofmt = av_guess_format(nullptr, path.c_str(), nullptr);
  LVX_CHECK(ofmt != nullptr, "video '", path,
            "': FFmpeg knows no container for this file extension (use .mp4, .mkv, .avi, ...)");
  AVFormatContext* raw = nullptr;
  LVX_AV_CHECK(avformat_alloc_output_context2(&raw, ofmt, nullptr, partial_.c_str()), "video '",
               path, "': cannot set up the ", ofmt->name, " muxer");
  fmt_.reset(raw);

  const AVCodec* codec = avcodec_find_encoder_by_name(options.codec.c_str());
  LVX_CHECK(codec != nullptr && codec->type == AVMEDIA_TYPE_VIDEO, "video '", path,
            "': FFmpeg has no video encoder named '", options.codec, "'");
  stream_ = avformat_new_stream(fmt_.get(), nullptr);
  LVX_CHECK(stream_ != nullptr, "avformat_new_stream: out of memory");
  codec_.reset(avcodec_alloc_context3(codec));
  LVX_CHECK(codec_ != nullptr, "avcodec_alloc_context3: out of memory");
  AVCodecContext* c = codec_.get();
  c->width = width;
  c->height = height;
  c->pix_fmt = AV_PIX_FMT_YUV420P;
  c->time_base = av_inv_q(fps);  // one tick per frame: frame i has pts i
  c->framerate = fps;
  c->gop_size = options.keyframe_interval;
  c->max_b_frames = 0;  // presentation order = coding order: simplest to seek and to check
  c->thread_count = options.threads;
  // Tag the matrix and range swscale uses below, so every reader converts back the same way.
  c->colorspace = AVCOL_SPC_SMPTE170M;
  c->color_primaries = AVCOL_PRI_SMPTE170M;
  c->color_trc = AVCOL_TRC_SMPTE170M;
  c->color_range = AVCOL_RANGE_MPEG;
  if (options.bit_rate > 0) {
    c->bit_rate = options.bit_rate;
  } else {
    c->flags |= AV_CODEC_FLAG_QSCALE;
    c->global_quality = FF_QP2LAMBDA * options.quality;
  }
  if (fmt_->oformat->flags & AVFMT_GLOBALHEADER) c->flags |= AV_CODEC_FLAG_GLOBAL_HEADER;
  LVX_AV_CHECK(avcodec_open2(c, codec, nullptr), "video '", path, "': cannot open the ",
               codec->name, " encoder for ", width, "x", height, " at ", fps.num, "/", fps.den,
               " fps");
  LVX_AV_CHECK(avcodec_parameters_from_context(stream_->codecpar, c), "video '", path,
               "': cannot copy the encoder parameters to the stream");
  stream_->time_base = c->time_base;  // a hint: the muxer may pick its own in write_header
  stream_->avg_frame_rate = fps;

  if (!(fmt_->oformat->flags & AVFMT_NOFILE))
    LVX_AV_CHECK(avio_open(&fmt_->pb, partial_.c_str(), AVIO_FLAG_WRITE), "video '", path,
                 "': cannot create '", partial_, "'");
  LVX_AV_CHECK(avformat_write_header(fmt_.get(), nullptr), "video '", path, "': cannot write the ",
               fmt_->oformat->name, " header");

  sws_.reset(sws_getContext(width, height, AV_PIX_FMT_RGB24, width, height, AV_PIX_FMT_YUV420P,
                            SWS_BICUBIC | SWS_ACCURATE_RND, nullptr, nullptr, nullptr));
  LVX_CHECK(sws_ != nullptr, "video '", path, "': swscale cannot convert rgb24 to yuv420p");
  frame_ = make_av_frame();
  frame_->format = AV_PIX_FMT_YUV420P;
  frame_->width = width;
  frame_->height = height;
  frame_->colorspace = c->colorspace;
  frame_->color_range = c->color_range;
  LVX_AV_CHECK(av_frame_get_buffer(frame_.get(), 0), "video '", path, "': cannot allocate a frame");
  packet_ = make_av_packet();
}

VideoWriter::~VideoWriter() {
  if (closed_) return;
  release();
  ::unlink(partial_.c_str());  // an unfinished file is no video: leave nothing behind
}

void VideoWriter::release() {
  sws_.reset();
  frame_.reset();
  packet_.reset();
  codec_.reset();
  fmt_.reset();  // closes the file
}

void VideoWriter::write(const at::Tensor& rgb, bool keyframe) {
  LVX_CHECK(!closed_, "video '", path_, "': write after close()");
  LVX_CHECK(rgb.device().is_cpu() && rgb.scalar_type() == at::kByte && rgb.dim() == 3 &&
                rgb.size(0) == height_ && rgb.size(1) == width_ && rgb.size(2) == 3,
            "video '", path_, "': a frame must be a CPU uint8 tensor [", height_, ", ", width_,
            ", 3] (RGB), got ", rgb.scalar_type(), " ", rgb.sizes(), " on ", rgb.device());
  const at::Tensor c = rgb.contiguous();
  write_rgb(c.data_ptr<uint8_t>(), 3 * static_cast<int64_t>(width_), keyframe);
}

void VideoWriter::write(const cv::Mat& rgb, bool keyframe) {
  LVX_CHECK(!closed_, "video '", path_, "': write after close()");
  LVX_CHECK(rgb.type() == CV_8UC3 && rgb.rows == height_ && rgb.cols == width_, "video '", path_,
            "': a frame must be a CV_8UC3 Mat of ", height_, "x", width_,
            " (rows x cols), got type ", rgb.type(), " ", rgb.rows, "x", rgb.cols);
  write_rgb(rgb.data, static_cast<int64_t>(rgb.step[0]), keyframe);
}

void VideoWriter::write_rgb(const uint8_t* data, int64_t row_stride, bool keyframe) {
  // The encoder may still hold a reference to the previous frame's buffers.
  LVX_AV_CHECK(av_frame_make_writable(frame_.get()), "video '", path_,
               "': cannot get a writable frame");
  const uint8_t* src[1] = {data};
  const int stride[1] = {static_cast<int>(row_stride)};
  sws_scale(sws_.get(), src, stride, 0, height_, frame_->data, frame_->linesize);
  frame_->pts = frames_;
  frame_->pict_type =
      keyframe ? AV_PICTURE_TYPE_I : AV_PICTURE_TYPE_NONE;  // NONE: encoder's choice
  encode(frame_.get());
  ++frames_;
}

void VideoWriter::encode(AVFrame* frame) {
  LVX_AV_CHECK(avcodec_send_frame(codec_.get(), frame), "video '", path_, "': cannot encode frame ",
               frames_);
  while (true) {
    const int r = avcodec_receive_packet(codec_.get(), packet_.get());
    if (r == AVERROR(EAGAIN) || r == AVERROR_EOF) return;
    LVX_AV_CHECK(r, "video '", path_, "': encoder error");
    av_packet_rescale_ts(packet_.get(), codec_->time_base, stream_->time_base);
    packet_->stream_index = stream_->index;
    // Takes ownership of the packet's data and resets it.
    LVX_AV_CHECK(av_interleaved_write_frame(fmt_.get(), packet_.get()), "video '", path_,
                 "': cannot write to '", partial_, "'");
  }
}

void VideoWriter::close() {
  if (closed_) return;
  encode(nullptr);
  LVX_AV_CHECK(av_write_trailer(fmt_.get()), "video '", path_, "': cannot write the trailer");
  if (!(fmt_->oformat->flags & AVFMT_NOFILE))
    LVX_AV_CHECK(avio_closep(&fmt_->pb), "video '", path_, "': cannot close '", partial_, "'");
  release();
  LVX_CHECK(std::rename(partial_.c_str(), path_.c_str()) == 0, "video '", path_,
            "': cannot rename '", partial_, "' to it: ", std::strerror(errno));
  closed_ = true;
}

}  // namespace lvx::video
