// Decoding against the ffmpeg CLI: videos made here with ffmpeg in every required codec and
// container; lvx's frames must equal ffmpeg's own decode + conversion (same swscale flags) bit
// for bit, at the indices the sampling rule picks, in any request order, with the frame count
// and pts taken from the content (ffprobe's decoded frames are the reference).
#include <gtest/gtest.h>

#include <cstring>

#include "tests/video_test_util.h"
#include "video/decoder.h"
#include "video/pipeline.h"
#include "video/sampler.h"

namespace lvx::video {
namespace {

using testing::make_video;
using testing::reference_frames;
using testing::reference_pts;

struct CodecCase {
  std::string name;  // test name and file stem
  std::string ext;
  std::string args;   // ffmpeg encoding arguments
  std::string codec;  // what VideoInfo::codec must say
  std::string size = "64x48";
};

std::string print_case(const ::testing::TestParamInfo<CodecCase>& info) { return info.param.name; }
// Readable parameters in test logs (instead of a byte dump).
void PrintTo(const CodecCase& c, std::ostream* os) { *os << c.name; }

// testsrc2 moves every frame, so a frame off by one never compares equal.
std::string source(const std::string& size, int fps = 25, double seconds = 2.0) {
  return "testsrc2=size=" + size + ":rate=" + std::to_string(fps) +
         ":duration=" + std::to_string(seconds);
}

std::vector<uint8_t> pixels(const DecodedFrame& f) {
  const uint8_t* p = f.rgb.data;
  return std::vector<uint8_t>(p, p + f.rgb.total() * 3);
}

class VideoCodecTest : public ::testing::TestWithParam<CodecCase> {};

TEST_P(VideoCodecTest, FramesEqualFfmpegAtSampledIndicesInAnyOrder) {
  const CodecCase& c = GetParam();
  const std::string path = make_video(c.name + "." + c.ext, source(c.size), c.args);
  VideoDecoder dec(path);
  const VideoInfo& info = dec.info();
  EXPECT_EQ(info.codec, c.codec);
  const auto ref_pts = reference_pts(path);
  ASSERT_EQ(info.num_frames, static_cast<int64_t>(ref_pts.size()));
  for (int64_t i = 0; i < info.num_frames; ++i)
    EXPECT_NEAR(dec.index().pts_seconds(i), ref_pts[i], 1e-6) << "frame " << i;
  const auto ref = reference_frames(path, info.width, info.height);
  ASSERT_EQ(static_cast<int64_t>(ref.size()), info.num_frames);
  // Forward, backward, repeated and far jumps; then the uniform rule's indices.
  std::vector<int64_t> order = {0, 37, 3, 17, 17, 49, 1, 48, 24, 0};
  SampleSpec spec;
  spec.num_frames = 7;
  for (int64_t i : sample_frames(dec.index().timeline(), spec).indices) order.push_back(i);
  for (int64_t i : order) {
    DecodedFrame f;
    std::string why;
    ASSERT_TRUE(dec.decode_frame(i, &f, &why)) << "frame " << i << ": " << why;
    EXPECT_EQ(f.index, i);
    ASSERT_EQ(f.rgb.cols, info.width);
    ASSERT_EQ(f.rgb.rows, info.height);
    EXPECT_TRUE(pixels(f) == ref[i]) << c.name << ": frame " << i << " differs from ffmpeg's";
  }
  EXPECT_EQ(dec.stats().decode_errors, 0);
}

INSTANTIATE_TEST_SUITE_P(
    Codecs, VideoCodecTest,
    ::testing::Values(
        CodecCase{"h264_mp4_bframes", "mp4", "-c:v libx264 -g 12 -bf 3 -pix_fmt yuv420p", "h264"},
        CodecCase{"h264_mkv_bt709", "mkv",
                  "-vf scale=out_color_matrix=bt709 -c:v libx264 -g 10 -pix_fmt yuv420p "
                  "-colorspace bt709 -color_primaries bt709 -color_trc bt709",
                  "h264"},
        CodecCase{"hevc_mkv_8bit", "mkv",
                  "-c:v libx265 -pix_fmt yuv420p -x265-params log-level=error:keyint=10", "hevc"},
        CodecCase{"hevc_mp4_10bit", "mp4",
                  "-c:v libx265 -pix_fmt yuv420p10le -tag:v hvc1 "
                  "-x265-params log-level=error:keyint=15",
                  "hevc"},
        CodecCase{"vp9_webm", "webm", "-c:v libvpx-vp9 -deadline realtime -g 10", "vp9"},
        CodecCase{"mpeg4_avi", "avi", "-c:v mpeg4 -g 10 -q:v 5", "mpeg4"},
        CodecCase{"mjpeg_avi_fullrange", "avi", "-c:v mjpeg -pix_fmt yuvj420p -q:v 5", "mjpeg"},
        CodecCase{"h264_mkv_odd_444", "mkv", "-c:v libx264 -g 8 -pix_fmt yuv444p", "h264", "75x45"},
        CodecCase{"vp9_webm_odd", "webm", "-c:v libvpx-vp9 -deadline realtime -g 8", "vp9",
                  "75x45"}),
    print_case);

// Colour: a flat colour encoded with a given matrix and range must come back as that colour.
// Tolerance 3 levels: YUV quantization and chroma siting; reading BT.709 data as BT.601 (or
// limited as full range) is off by 10+ levels for this colour, which the test checks it detects.
struct ColourCase {
  std::string name, matrix, range, pix_fmt;
};
void PrintTo(const ColourCase& c, std::ostream* os) { *os << c.name; }

class VideoColourTest : public ::testing::TestWithParam<ColourCase> {};

TEST_P(VideoColourTest, FlatColourSurvivesMatrixAndRange) {
  const ColourCase& c = GetParam();
  const int rgb[3] = {0x30, 0xA0, 0xE0};
  const std::string path = make_video(
      "colour_" + c.name + ".mkv", "color=c=0x30A0E0:size=32x32:rate=5:duration=1",
      "-vf scale=out_color_matrix=" + c.matrix + ":out_range=" + c.range + ",format=" + c.pix_fmt +
          " -c:v libx264 -qp 0 -colorspace " +
          (c.matrix == "bt601" ? std::string("smpte170m") : c.matrix) + " -color_range " + c.range);
  VideoDecoder dec(path);
  DecodedFrame f;
  std::string why;
  ASSERT_TRUE(dec.decode_frame(2, &f, &why)) << why;
  int worst = 0;
  for (int64_t p = 0; p < static_cast<int64_t>(f.rgb.total()); ++p)
    for (int ch = 0; ch < 3; ++ch)
      worst = std::max(worst, std::abs(int(f.rgb.data[3 * p + ch]) - rgb[ch]));
  EXPECT_LE(worst, 3) << c.name << ": colour " << dec.info().color_space << "/"
                      << dec.info().color_range;
}

INSTANTIATE_TEST_SUITE_P(Colour, VideoColourTest,
                         ::testing::Values(ColourCase{"bt601_limited", "bt601", "tv", "yuv420p"},
                                           ColourCase{"bt709_limited", "bt709", "tv", "yuv420p"},
                                           ColourCase{"bt709_full", "bt709", "pc", "yuv420p"},
                                           ColourCase{"bt601_full", "bt601", "pc", "yuv444p"}),
                         [](const auto& i) { return i.param.name; });

TEST(VideoColour, WrongMatrixWouldBeDetected) {
  // Decoded, not computed: the flat colour converted to YUV with one matrix and range but tagged
  // with another, so the decoder (which honours the tag) converts back with the wrong one. Each
  // mismatch must land beyond the 3-level tolerance FlatColourSurvivesMatrixAndRange uses, so a
  // decoder ignoring the matrix or the range fails that test; the correctly tagged clip stays
  // within it.
  const int rgb[3] = {0x30, 0xA0, 0xE0};
  auto worst_error = [&](const std::string& name, const std::string& matrix,
                         const std::string& range, const std::string& tag_matrix,
                         const std::string& tag_range) {
    const std::string path =
        make_video("colour_tag_" + name + ".mkv", "color=c=0x30A0E0:size=32x32:rate=5:duration=1",
                   "-vf scale=out_color_matrix=" + matrix + ":out_range=" + range +
                       ",format=yuv444p -c:v libx264 -qp 0 -colorspace " + tag_matrix +
                       " -color_range " + tag_range);
    VideoDecoder dec(path);
    DecodedFrame f;
    std::string why;
    EXPECT_TRUE(dec.decode_frame(2, &f, &why)) << why;
    int worst = 0;
    for (int64_t p = 0; p < static_cast<int64_t>(f.rgb.total()); ++p)
      for (int ch = 0; ch < 3; ++ch)
        worst = std::max(worst, std::abs(int(f.rgb.data[3 * p + ch]) - rgb[ch]));
    return worst;
  };
  EXPECT_LE(worst_error("right", "bt709", "tv", "bt709", "tv"), 3);
  // BT.709 data read as BT.601 (smpte170m), and the other way round.
  EXPECT_GT(worst_error("709_as_601", "bt709", "tv", "smpte170m", "tv"), 3);
  EXPECT_GT(worst_error("601_as_709", "bt601", "tv", "bt709", "tv"), 3);
  // Limited-range data read as full range.
  EXPECT_GT(worst_error("tv_as_pc", "bt709", "tv", "bt709", "pc"), 3);
}

// Rotation: a remux with the "rotate" tag makes ffmpeg 5.1's mov muxer write a display matrix;
// frames must come out as ffmpeg's autorotation shows them, width and height swapped for
// 90/270, and info().rotation must be the clockwise turn the matrix asks for (ffprobe's reading
// of the matrix, negated: ffprobe prints av_display_rotation_get, counter-clockwise).
class VideoRotationTest : public ::testing::TestWithParam<int> {};

TEST_P(VideoRotationTest, FramesAreShownAsAPlayerShowsThem) {
  const int deg = GetParam();
  const std::string plain =
      make_video("unrotated.mp4", source("64x48", 25, 1.0), "-c:v libx264 -g 5 -pix_fmt yuv420p");
  const std::string path = (testing::temp_dir() / ("rot" + std::to_string(deg) + ".mp4")).string();
  testing::run("ffmpeg -nostdin -v error -y -i '" + plain +
               "' -c copy -metadata:s:v:0 rotate=" + std::to_string(deg) + " '" + path + "'");
  VideoDecoder dec(path);
  const int ccw = testing::reference_display_rotation(path);
  ASSERT_NE(ccw, 0) << "the remux wrote no display matrix";
  EXPECT_EQ(dec.info().rotation, ((-ccw) % 360 + 360) % 360);
  const bool swap = deg == 90 || deg == 270;
  EXPECT_EQ(dec.info().width, swap ? 48 : 64);
  EXPECT_EQ(dec.info().height, swap ? 64 : 48);
  // lvx converts to RGB, then turns the RGB image (lossless): exactly ffmpeg's conversion
  // followed by the same turn. ffmpeg's autorotation turns the YUV planes before converting,
  // which moves chroma interpolation to the other axis: equal within 2% of levels on average
  // and a few dozen at the sharpest testsrc2 edges.
  const char* turn = dec.info().rotation == 90    ? "transpose=clock"
                     : dec.info().rotation == 180 ? "hflip,vflip"
                                                  : "transpose=cclock";
  const auto exact = reference_frames(path, dec.info().width, dec.info().height, turn);
  const auto shown = reference_frames(path, dec.info().width, dec.info().height);
  ASSERT_EQ(static_cast<int64_t>(exact.size()), dec.info().num_frames);
  ASSERT_EQ(static_cast<int64_t>(shown.size()), dec.info().num_frames);
  for (int64_t i : {3, 0, 20}) {
    DecodedFrame f;
    std::string why;
    ASSERT_TRUE(dec.decode_frame(i, &f, &why)) << why;
    const auto got = pixels(f);
    EXPECT_TRUE(got == exact[i]) << "rotation " << deg << " frame " << i;
    double sum = 0;
    for (size_t k = 0; k < got.size(); ++k) sum += std::abs(int(got[k]) - int(shown[i][k]));
    EXPECT_LT(sum / got.size(), 0.02 * 255) << "rotation " << deg << " frame " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Rotation, VideoRotationTest, ::testing::Values(90, 180, 270));

// Variable frame rate: pts come from the stream (not fps × index), and fps sampling picks the
// frame visible at each timestamp by the documented rule, checked against ffprobe's pts.
TEST(VideoVfr, IndexAndFpsSamplingFollowTheContent) {
  const std::string path = make_video(
      "vfr.mkv", source("64x48", 25, 3.0),
      "-vf \"setpts='if(lt(N,20),N*0.04,0.8+(N-20)*0.15)/TB'\" -vsync vfr -c:v libx264 -g 9 "
      "-pix_fmt yuv420p");
  VideoDecoder dec(path);
  const auto ref_pts = reference_pts(path);
  ASSERT_EQ(dec.info().num_frames, static_cast<int64_t>(ref_pts.size()));
  ASSERT_GT(ref_pts.size(), 30u);
  for (size_t i = 0; i < ref_pts.size(); ++i)
    EXPECT_NEAR(dec.index().pts_seconds(i), ref_pts[i], 1e-6);
  // Really variable: 40 ms gaps at the start, 150 ms at the end (not index / average fps).
  EXPECT_NEAR(ref_pts[2] - ref_pts[1], 0.04, 1e-3);
  EXPECT_GT(ref_pts.back() - ref_pts[ref_pts.size() - 2], 0.12);
  SampleSpec spec;
  spec.fps = 4;
  spec.start = 0.3;
  const auto s = sample_frames(dec.index().timeline(), spec);
  const auto ref = reference_frames(path, 64, 48);
  for (size_t k = 0; k < s.indices.size(); ++k) {
    const double t = 0.3 + k / 4.0;
    int64_t expect = 0;
    for (size_t i = 0; i < ref_pts.size(); ++i)
      if (ref_pts[i] <= t + 1e-9) expect = static_cast<int64_t>(i);
    ASSERT_EQ(s.indices[k], expect) << "t = " << t;
    DecodedFrame f;
    std::string why;
    ASSERT_TRUE(dec.decode_frame(s.indices[k], &f, &why)) << why;
    EXPECT_TRUE(pixels(f) == ref[expect]) << "t = " << t;
  }
}

// Container metadata that lies: a stream copy cut at 1.3 s (not a keyframe) keeps all 100
// samples in the mp4 header (nb_frames = 100) plus an edit list hiding the first 33; only 67
// frames are ever shown. The count and the frames come from the content (decord #373).
TEST(VideoMetadata, FrameCountComesFromTheContentNotTheHeader) {
  const std::string src = make_video("el_src.mp4", source("64x48", 25, 4.0),
                                     "-c:v libx264 -g 50 -bf 2 -pix_fmt yuv420p");
  const std::string path = (testing::temp_dir() / "edit_list.mp4").string();
  testing::run("ffmpeg -nostdin -v error -y -ss 1.3 -i '" + src + "' -c copy '" + path + "'");
  VideoDecoder dec(path);
  const auto ref_pts = reference_pts(path);
  const int64_t header = std::stoll(testing::run(
      "ffprobe -v error -select_streams v:0 -show_entries stream=nb_frames -of csv=p=0 '" + path +
      "'"));
  EXPECT_EQ(dec.info().num_frames_from_header, header);
  ASSERT_EQ(dec.info().num_frames, static_cast<int64_t>(ref_pts.size()));
  EXPECT_LT(dec.info().num_frames, header) << "the cut did not make the header lie";
  const auto ref = reference_frames(path, 64, 48);
  ASSERT_EQ(ref.size(), ref_pts.size());
  for (int64_t i : std::vector<int64_t>{0, 1, 40, static_cast<int64_t>(ref.size()) - 1, 5}) {
    DecodedFrame f;
    std::string why;
    ASSERT_TRUE(dec.decode_frame(i, &f, &why)) << why;
    EXPECT_NEAR(f.pts_seconds, ref_pts[i], 1e-6);
    EXPECT_TRUE(pixels(f) == ref[i]) << "frame " << i;
  }
}

// A few frames from a long GOP-structured video decode a few GOPs, not the whole file.
TEST(VideoSeek, SampledFramesDecodeOnlyTheirGops) {
  const std::string path = make_video("long.mp4", source("32x32", 25, 40.0),
                                      "-c:v libx264 -g 25 -bf 2 -pix_fmt yuv420p");
  VideoDecoder dec(path);
  ASSERT_EQ(dec.info().num_frames, 1000);
  SampleSpec spec;
  spec.num_frames = 8;
  for (int64_t i : sample_frames(dec.index().timeline(), spec).indices) {
    DecodedFrame f;
    std::string why;
    ASSERT_TRUE(dec.decode_frame(i, &f, &why)) << why;
  }
  // Each sampled frame needs at most its GOP (25) plus the decoder's reorder delay.
  EXPECT_LE(dec.stats().frames_decoded, 8 * (25 + 4));
  EXPECT_LT(dec.stats().packets_read, 300);
  EXPECT_EQ(dec.stats().fallback_seeks, 0);
}

}  // namespace
}  // namespace lvx::video
