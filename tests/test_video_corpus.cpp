// Timestamps as players show them, on every common container: a corpus made here with the ffmpeg
// CLI whose frames name their own index (the source frame number is written in 2-bit grey
// levels of 8 blocks, which survive lossy coding), decoded by lvx with fps, uniform-N and
// time-range sampling and compared with the frames and pts the ffmpeg CLI decodes
// (`-vsync passthrough`). The rules (docs/video.md): time 0 is the first displayed frame, the
// video ends where its last frame stops being shown.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "tests/video_test_util.h"
#include "video/index_cache.h"
#include "video/pipeline.h"
#include "video/sampler.h"

namespace lvx::video {
namespace {

using testing::run;
using testing::temp_dir;

constexpr int kW = 64, kH = 48, kRate = 10;

// 8 blocks of 16x24 pixels; block b holds base-4 digit b of the frame number as grey 0/85/170/255.
std::string coded_source(double seconds) {
  return "color=c=black:size=64x48:rate=" + std::to_string(kRate) +
         ":duration=" + std::to_string(seconds) +
         ",format=yuv444p,geq=lum=mod(floor(N/pow(4\\,floor(X/16)+4*floor(Y/24)))\\,4)*85:"
         "cb=128:cr=128";
}

// The frame number an RGB frame (H×W×3, row-major) names, from the centre of each block.
int64_t frame_code(const uint8_t* rgb) {
  static const int kLevels[4] = {0, 80, 179, 255};  // 0/85/170/255 limited-range luma → RGB
  int64_t code = 0, scale = 1;
  for (int b = 0; b < 8; ++b, scale *= 4) {
    const int x0 = (b % 4) * 16 + 4, y0 = (b / 4) * 24 + 8;
    double sum = 0;
    for (int y = y0; y < y0 + 8; ++y)
      for (int x = x0; x < x0 + 8; ++x) sum += rgb[(y * kW + x) * 3 + 1];
    const double v = sum / 64;
    int best = 0;
    for (int l = 1; l < 4; ++l)
      if (std::abs(v - kLevels[l]) < std::abs(v - kLevels[best])) best = l;
    code += best * scale;
  }
  return code;
}

struct CorpusCase {
  std::string name, ext;
  std::string encoder;  // must be in `ffmpeg -encoders`, else the case is skipped
  std::string args;     // encoding arguments after the input
  double seconds = 3.0;
  std::string filter = "";   // extra filters on the coded source (e.g. VFR timing)
  std::string remux = "";    // then `ffmpeg -i made <remux> final` (e.g. a cut with an edit list)
  double duration = 3.0;     // the video's duration by construction (player time)
  std::string decoder = "";  // must be in `ffmpeg -decoders` too, when set
};
void PrintTo(const CorpusCase& c, std::ostream* os) { *os << c.name; }

bool ffmpeg_lists(const std::string& what, const std::string& name) {
  static std::map<std::string, std::string> lists;
  if (!lists.count(what)) lists[what] = run("ffmpeg -hide_banner -" + what + " 2>/dev/null");
  return lists[what].find(" " + name + " ") != std::string::npos;
}

std::string make_case(const CorpusCase& c) {
  const std::string path = (temp_dir() / ("corpus_" + c.name + "." + c.ext)).string();
  const std::string made = c.remux.empty() ? path : path + ".src.mkv";
  std::string src = coded_source(c.seconds);
  if (!c.filter.empty()) src += "," + c.filter;
  run("ffmpeg -nostdin -v error -y -f lavfi -i '" + src + "' " + c.args + " '" + made + "'");
  if (!c.remux.empty())
    run("ffmpeg -nostdin -v error -y " + c.remux + " -i '" + made + "' -c copy '" + path + "'");
  return path;
}

// What the ffmpeg CLI decodes: every frame's stream pts (ffprobe) and the number it names.
struct Reference {
  std::vector<double> pts;
  std::vector<int64_t> code;
};

Reference reference(const std::string& path) {
  Reference r;
  // The pts the ffmpeg CLI prints for each frame it decodes (-copyts: the stream's own clock).
  std::istringstream ss(run("ffmpeg -nostdin -hide_banner -copyts -i '" + path +
                            "' -vsync passthrough -vf showinfo -f null - 2>&1 | grep -o "
                            "'pts_time:[-0-9.e]*' | cut -d: -f2"));
  for (std::string line; std::getline(ss, line);)
    if (!line.empty()) r.pts.push_back(std::stod(line));
  const auto frames = testing::reference_frames(path, kW, kH);
  for (const auto& f : frames) r.code.push_back(frame_code(f.data()));
  return r;
}

std::vector<int64_t> codes(const FrameBatch& b) {
  const at::Tensor hwc = b.frames.permute({0, 2, 3, 1}).contiguous();
  std::vector<int64_t> out;
  for (int64_t k = 0; k < hwc.size(0); ++k) out.push_back(frame_code(hwc[k].data_ptr<uint8_t>()));
  return out;
}

// The documented rules restated on the reference: frame shown at player time t.
int64_t shown_at(const std::vector<double>& times, double t) {
  int64_t best = 0;
  for (size_t i = 0; i < times.size(); ++i)
    if (times[i] <= t + 1e-9) best = static_cast<int64_t>(i);
  return best;
}

class VideoCorpusTest : public ::testing::TestWithParam<CorpusCase> {};

TEST_P(VideoCorpusTest, SamplingFollowsPlayerTimeAsFfmpegDecodes) {
  const CorpusCase& c = GetParam();
  if (!ffmpeg_lists("encoders", c.encoder))
    GTEST_SKIP() << "this ffmpeg has no " << c.encoder << " encoder";
  if (!c.decoder.empty() && !ffmpeg_lists("decoders", c.decoder))
    GTEST_SKIP() << "this ffmpeg has no " << c.decoder << " decoder";
  const std::string path = make_case(c);
  const Reference ref = reference(path);
  ASSERT_GE(ref.pts.size(), 10u);
  ASSERT_EQ(ref.pts.size(), ref.code.size()) << "ffprobe and ffmpeg disagree on the frame count";
  for (size_t i = 1; i < ref.code.size(); ++i)
    ASSERT_GT(ref.code[i], ref.code[i - 1]) << "the corpus frames must name distinct frames";
  std::vector<double> times;
  for (double p : ref.pts) times.push_back(p - ref.pts[0]);

  PreprocessConfig native;
  native.image_size = 0;
  auto check = [&](const SampleSpec& spec, const std::vector<int64_t>& expect,
                   const std::string& what) {
    const FrameBatch b = decode_video(path, spec, {}, native);
    ASSERT_EQ(b.info.num_frames, static_cast<int64_t>(ref.pts.size())) << what;
    EXPECT_NEAR(b.info.begin_seconds, ref.pts[0], 1e-6) << what;
    EXPECT_NEAR(b.info.duration_seconds, c.duration, 1e-3) << what;
    ASSERT_EQ(b.indices.size(0), static_cast<int64_t>(expect.size())) << what;
    const auto got = codes(b);
    for (size_t k = 0; k < expect.size(); ++k) {
      const int64_t i = expect[k];
      EXPECT_EQ(b.indices[k].item<int64_t>(), i) << what << " sample " << k;
      EXPECT_EQ(got[k], ref.code[i]) << what << " sample " << k << ": decoded the wrong frame";
      EXPECT_NEAR(b.pts[k].item<double>(), times[i], 1e-6) << what << " sample " << k;
      EXPECT_NEAR(b.stream_pts[k].item<double>(), ref.pts[i], 1e-6) << what << " sample " << k;
    }
  };
  {  // fps 2 over the whole video: t = 0, 0.5, ... < duration.
    SampleSpec s;
    s.fps = 2;
    std::vector<int64_t> expect;
    for (int k = 0; k / 2.0 < c.duration - 1e-9; ++k) expect.push_back(shown_at(times, k / 2.0));
    check(s, expect, "fps 2");
  }
  {  // fps 1: one frame per whole second of the video, never one past its end.
    SampleSpec s;
    s.fps = 1;
    std::vector<int64_t> expect;
    for (int k = 0; k < c.duration - 1e-9; ++k) expect.push_back(shown_at(times, k));
    EXPECT_EQ(static_cast<double>(expect.size()), std::ceil(c.duration - 1e-9));
    check(s, expect, "fps 1");
  }
  {  // uniform 7: first and last frame included, rounding half to even.
    SampleSpec s;
    s.num_frames = 7;
    const int64_t last = static_cast<int64_t>(times.size()) - 1;
    std::vector<int64_t> expect;
    for (int64_t k = 0; k < 7; ++k) expect.push_back(round_div_half_even(k * last, 6));
    check(s, expect, "uniform 7");
  }
  {  // time range [0.55, 1.45) at 4 fps, in player time.
    SampleSpec s;
    s.fps = 4;
    s.start = 0.55;
    s.end = 1.45;
    std::vector<int64_t> expect;
    for (int k = 0; 0.55 + k / 4.0 < 1.45; ++k) expect.push_back(shown_at(times, 0.55 + k / 4.0));
    check(s, expect, "range");
  }
}

const std::string kH264 = "-c:v libx264 -g 12 -bf 3 -pix_fmt yuv420p";
const std::string kMpeg2 = "-c:v mpeg2video -g 12 -bf 2 -q:v 4";

INSTANTIATE_TEST_SUITE_P(
    Corpus, VideoCorpusTest,
    ::testing::Values(
        CorpusCase{"h264_mp4", "mp4", "libx264", kH264},
        // B-frame delay without an edit list: the first frame is at 0.2 s.
        CorpusCase{"h264_mp4_no_editlist", "mp4", "libx264", kH264 + " -use_editlist 0"},
        CorpusCase{"h264_fragmented_mp4", "mp4", "libx264",
                   kH264 + " -movflags frag_keyframe+empty_moov"},
        // A stream copy cut at 1.3 s (not a keyframe): an edit list hides the first frames.
        CorpusCase{"h264_mov_editlist", "mov", "libx264", kH264, 3.0, "", "-ss 1.3", 1.7},
        CorpusCase{"h264_open_gop_mkv", "mkv", "libx264",
                   kH264 + " -x264-params open-gop=1:log-level=error"},
        CorpusCase{"h264_ts", "ts", "libx264", kH264},
        CorpusCase{"h264_ts_offset", "ts", "libx264", kH264 + " -output_ts_offset 7.5"},
        CorpusCase{"h264_flv", "flv", "libx264", kH264},
        CorpusCase{"mpeg2_ts", "ts", "mpeg2video", kMpeg2},
        CorpusCase{"mpeg2_ps", "mpg", "mpeg2video", kMpeg2 + " -f vob"},
        CorpusCase{
            "hevc_mkv", "mkv", "libx265",
            "-c:v libx265 -pix_fmt yuv420p -x265-params log-level=error:keyint=12:bframes=3"},
        CorpusCase{
            "hevc_ts", "ts", "libx265",
            "-c:v libx265 -pix_fmt yuv420p -x265-params log-level=error:keyint=12:bframes=3"},
        CorpusCase{"vp9_webm", "webm", "libvpx-vp9", "-c:v libvpx-vp9 -deadline realtime -g 12"},
        CorpusCase{"av1_mkv", "mkv", "libaom-av1", "-c:v libaom-av1 -cpu-used 8 -g 12", 3.0, "", "",
                   3.0, "libdav1d"},
        CorpusCase{"mpeg4_avi", "avi", "mpeg4", "-c:v mpeg4 -g 12 -q:v 4"},
        CorpusCase{"mpeg4_mp4_bframes", "mp4", "mpeg4", "-c:v mpeg4 -g 12 -bf 2 -q:v 4"},
        CorpusCase{"mjpeg_avi", "avi", "mjpeg", "-c:v mjpeg -pix_fmt yuvj420p -q:v 3"},
        CorpusCase{"h264_mkv_offset", "mkv", "libx264", kH264 + " -output_ts_offset 4.25"},
        // Variable frame rate: 20 frames 0.1 s apart, then 10 frames 0.25 s apart; the last
        // starts at 4.25 s and the file states 4.3 s (its last block lasts the nominal 0.1 s,
        // cut to the stated end: the container's duration wins when consistent).
        CorpusCase{"h264_vfr_mkv", "mkv", "libx264", kH264 + " -vsync vfr", 3.0,
                   "setpts=if(lt(N\\,20)\\,N*0.1\\,2+(N-20)*0.25)/TB", "", 4.3}),
    [](const auto& i) { return i.param.name; });

// Every rank of a sharded decode gets the same index, built by one of them: ranks started
// together wait for the first one's scan and read it from the cache.
TEST(VideoIndexCache, RanksShareOneIndexBuiltOnce) {
  const std::string path = (temp_dir() / "cache_ranks.ts").string();
  run("ffmpeg -nostdin -v error -y -f lavfi -i '" + coded_source(6.0) + "' " + kH264 + " '" + path +
      "'");
  PreprocessConfig native;
  native.image_size = 0;
  SampleSpec spec;
  spec.fps = 3;
  const FrameBatch all = decode_video(path, spec, {}, native, DecodeOptions{});
  std::remove(index_cache_file(path, 0).c_str());
  constexpr int kWorld = 4;
  std::vector<FrameBatch> shards(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r)
    ranks.emplace_back([&, r] { shards[r] = decode_video(path, spec, {r, kWorld}, native); });
  for (auto& t : ranks) t.join();
  int scanned = 0;
  std::vector<at::Tensor> idx, pts;
  for (const auto& b : shards) {
    scanned += !b.info.index_from_cache;
    EXPECT_EQ(b.info.num_frames, all.info.num_frames);
    EXPECT_EQ(b.info.duration_seconds, all.info.duration_seconds);
    EXPECT_EQ(b.report.sampled_total, all.report.sampled_total);
    idx.push_back(b.indices);
    pts.push_back(b.pts);
  }
  EXPECT_EQ(scanned, 1) << "one rank scans, the others read its index";
  EXPECT_TRUE(at::equal(lvx::video::testing::interleave(idx), all.indices));
  EXPECT_TRUE(at::equal(lvx::video::testing::interleave(pts), all.pts));
}

TEST(VideoIndexCache, ChangedOrCorruptEntriesAreRebuilt) {
  const std::string path = (temp_dir() / "cache_change.mp4").string();
  auto make = [&](double seconds) {
    run("ffmpeg -nostdin -v error -y -f lavfi -i '" + coded_source(seconds) + "' " + kH264 + " '" +
        path + "'");
  };
  make(2.0);
  PreprocessConfig native;
  native.image_size = 0;
  SampleSpec spec;
  spec.num_frames = 3;
  EXPECT_FALSE(decode_video(path, spec, {}, native).info.index_from_cache);
  const FrameBatch cached = decode_video(path, spec, {}, native);
  EXPECT_TRUE(cached.info.index_from_cache);
  EXPECT_EQ(cached.info.num_frames, 20);
  EXPECT_EQ(cached.report.stats.packets_scanned, 0);
  // The file changes (size and mtime): the old entry must not be used.
  make(3.0);
  const FrameBatch changed = decode_video(path, spec, {}, native);
  EXPECT_FALSE(changed.info.index_from_cache);
  EXPECT_EQ(changed.info.num_frames, 30);
  EXPECT_EQ(changed.indices[2].item<int64_t>(), 29);
  // A damaged entry (a flipped byte: the checksum) is scanned again and rewritten.
  const std::string entry = index_cache_file(path, 0);
  ASSERT_FALSE(entry.empty());
  {
    std::fstream f(entry, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(40);
    f.put('\x7f');
  }
  const FrameBatch repaired = decode_video(path, spec, {}, native);
  EXPECT_FALSE(repaired.info.index_from_cache);
  EXPECT_EQ(repaired.info.num_frames, 30);
  EXPECT_TRUE(decode_video(path, spec, {}, native).info.index_from_cache);
  // Turned off: never read.
  DecodeOptions off;
  off.index_cache = false;
  EXPECT_FALSE(decode_video(path, spec, {}, native, off).info.index_from_cache);
}

}  // namespace
}  // namespace lvx::video
