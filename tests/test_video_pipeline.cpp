// The per-rank pipeline and `lvx decode` end to end: shards whose union is exactly the
// single-rank result, preprocessing equal to PIL's resize (the processors' own library), the
// bounded queue, and every kind of bad input: a clear error naming the file, exit code 1, and
// no output file.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "src/common/error.h"
#include "src/common/safetensors.h"
#include "tests/build_paths.h"
#include "tests/video_test_util.h"
#include "video/bounded_queue.h"
#include "video/pipeline.h"
#include "video/preprocess.h"

namespace lvx::video {
namespace {

using testing::make_video;
using testing::run;
using testing::temp_dir;

bool file_exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

std::string lvx_bin() { return lvx::testing::binary_dir() + "/lvx"; }

std::string h264_video() {
  return make_video("pipe_h264.mp4", "testsrc2=size=64x48:rate=25:duration=2",
                    "-c:v libx264 -g 10 -bf 2 -pix_fmt yuv420p");
}

PreprocessConfig keep_size() {
  PreprocessConfig c;
  c.image_size = 0;
  return c;
}

TEST(VideoPipeline, ShardsTogetherAreExactlyTheSingleRankResult) {
  const std::string path = h264_video();
  SampleSpec spec;
  spec.fps = 7;
  spec.start = 0.13;
  const FrameBatch all = decode_video(path, spec, {0, 1}, keep_size());
  ASSERT_EQ(all.frames.size(0), all.report.sampled_total);
  for (int64_t world : {2, 3, 5}) {
    std::vector<at::Tensor> frames, indices, pts;
    for (int64_t r = 0; r < world; ++r) {
      const FrameBatch b = decode_video(path, spec, {r, world}, keep_size());
      EXPECT_EQ(b.report.sampled_total, all.report.sampled_total);
      frames.push_back(b.frames);
      indices.push_back(b.indices);
      pts.push_back(b.pts);
    }
    EXPECT_TRUE(at::equal(lvx::video::testing::interleave(frames), all.frames)) << "world " << world;
    EXPECT_TRUE(at::equal(lvx::video::testing::interleave(indices), all.indices)) << "world " << world;
    EXPECT_TRUE(at::equal(lvx::video::testing::interleave(pts), all.pts)) << "world " << world;
  }
}

TEST(VideoPipeline, ThreadCountsDoNotChangeTheFrames) {
  const std::string path = make_video("threads_hevc.mkv", "testsrc2=size=64x48:rate=25:duration=2",
                                      "-c:v libx265 -x265-params log-level=error:keyint=12");
  SampleSpec spec;
  spec.num_frames = 11;
  PreprocessConfig cfg = PreprocessConfig::siglip();
  cfg.image_size = 40;
  cfg.normalize = true;
  DecodeOptions one, many;
  many.threads = 0;  // FFmpeg's choice: frame threading across the cores
  many.queue_capacity = 1;
  many.preprocess_threads = 3;
  for (const PreprocessConfig& c : {keep_size(), cfg}) {
    const FrameBatch a = decode_video(path, spec, {}, c, one);
    const FrameBatch b = decode_video(path, spec, {}, c, many);
    EXPECT_TRUE(at::equal(a.frames, b.frames)) << "image_size " << c.image_size;
    EXPECT_TRUE(at::equal(a.indices, b.indices));
  }
}

TEST(VideoPipeline, BatchMatchesTheDecoderAndIsChannelsFirst) {
  const std::string path = h264_video();
  SampleSpec spec;
  spec.num_frames = 6;
  const FrameBatch b = decode_video(path, spec, {}, keep_size());
  ASSERT_EQ(b.frames.sizes(), (at::IntArrayRef{6, 3, 48, 64}));
  EXPECT_EQ(b.frames.scalar_type(), at::kByte);
  EXPECT_EQ(b.indices.scalar_type(), at::kLong);
  EXPECT_EQ(b.pts.scalar_type(), at::kDouble);
  EXPECT_EQ(b.indices[5].item<int64_t>(), 49);  // both ends included
  VideoDecoder dec(path);
  for (int64_t k = 0; k < 6; ++k) {
    DecodedFrame f;
    std::string why;
    ASSERT_TRUE(dec.decode_frame(b.indices[k].item<int64_t>(), &f, &why));
    const at::Tensor hwc = at::from_blob(f.rgb.data, {48, 64, 3}, at::kByte);
    EXPECT_TRUE(at::equal(b.frames[k], hwc.permute({2, 0, 1}))) << "k " << k;
    EXPECT_DOUBLE_EQ(b.pts[k].item<double>(), f.pts_seconds);
  }
}

// PIL (Pillow, pinned in requirements.txt) is what CLIPImageProcessor, SiglipImageProcessor and
// torchvision call to resize uint8 images; lvx must match it exactly.
TEST(VideoPreprocess, ResizeEqualsPillowBicubic) {
  std::mt19937 rng(3);
  struct Case {
    int w, h, ow, oh;
  };
  for (const Case c : {Case{97, 61, 24, 24}, Case{20, 13, 64, 64}, Case{640, 360, 398, 224},
                       Case{33, 80, 33, 17}}) {
    cv::Mat img(c.h, c.w, CV_8UC3);
    for (size_t i = 0; i < img.total() * 3; ++i) img.data[i] = static_cast<uint8_t>(rng() & 255);
    const std::string in = (temp_dir() / "pil_in.rgb").string();
    const std::string out = (temp_dir() / "pil_out.rgb").string();
    std::ofstream(in, std::ios::binary)
        .write(reinterpret_cast<const char*>(img.data), img.total() * 3);
    run(lvx::testing::configured_python() +
        " -c \"from PIL import Image; im = Image.frombytes('RGB', (" + std::to_string(c.w) + "," +
        std::to_string(c.h) + "), open('" + in + "','rb').read()); open('" + out +
        "','wb').write(im.resize((" + std::to_string(c.ow) + "," + std::to_string(c.oh) +
        "), Image.BICUBIC).tobytes())\"");
    std::ifstream f(out, std::ios::binary);
    const std::vector<uint8_t> ref((std::istreambuf_iterator<char>(f)), {});
    const cv::Mat got = resize_bicubic_pil(img, c.ow, c.oh);
    ASSERT_EQ(ref.size(), got.total() * 3);
    int wrong = 0;
    for (size_t i = 0; i < ref.size(); ++i) wrong += ref[i] != got.data[i];
    EXPECT_EQ(wrong, 0) << c.w << "x" << c.h << " -> " << c.ow << "x" << c.oh;
  }
}

TEST(VideoPreprocess, ClipPresetCropsCentreAndNormalizes) {
  cv::Mat img(30, 50, CV_8UC3);
  for (int y = 0; y < 30; ++y)
    for (int x = 0; x < 50; ++x)
      img.at<cv::Vec3b>(y, x) = cv::Vec3b(uint8_t(5 * x), uint8_t(8 * y), uint8_t(x + y));
  PreprocessConfig cfg = PreprocessConfig::clip();
  cfg.image_size = 20;  // 50x30 → 33x20 (33 = int(20 * 50 / 30)), crop left = round(6.5) = 6
  cfg.normalize = true;
  at::Tensor out = at::empty({3, 20, 20}, at::kFloat);
  preprocess_frame(img, cfg, out);
  const cv::Mat resized = resize_bicubic_pil(img, 33, 20);
  for (int c = 0; c < 3; ++c)
    for (int y = 0; y < 20; y += 3)
      for (int x = 0; x < 20; x += 3) {
        const float v = resized.at<cv::Vec3b>(y, x + 6)[c];
        EXPECT_FLOAT_EQ(out[c][y][x].item<float>(), (v / 255.0f - cfg.mean[c]) / cfg.std[c]);
      }
  PreprocessConfig sig = PreprocessConfig::siglip();
  sig.image_size = 16;
  at::Tensor u8 = at::empty({3, 16, 16}, at::kByte);
  preprocess_frame(img, sig, u8);  // squash: no crop, aspect ratio not kept
  const cv::Mat squashed = resize_bicubic_pil(img, 16, 16);
  EXPECT_EQ(u8[1][15][15].item<uint8_t>(), squashed.at<cv::Vec3b>(15, 15)[1]);
}

TEST(VideoQueue, ProducerWaitsWhenFull) {
  BoundedQueue<int> q(2);
  std::atomic<int> pushed{0};
  std::thread producer([&] {
    for (int i = 0; i < 10; ++i) {
      q.push(i);
      ++pushed;
    }
    q.close();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(pushed.load(), 2);  // blocked on the third
  int expect = 0;
  while (auto v = q.pop()) EXPECT_EQ(*v, expect++);
  producer.join();
  EXPECT_EQ(expect, 10);
}

// ---------------------------------------------------------------- bad input
struct BadInput {
  std::string name;
  std::string path;
  std::string expect;  // in the error message
};

std::vector<BadInput> bad_inputs() {
  const auto dir = temp_dir();
  std::vector<BadInput> v;
  v.push_back({"missing", (dir / "does_not_exist.mp4").string(), "no such file"});
  const std::string text = (dir / "notes.mp4").string();
  std::ofstream(text) << "this is not a video, just text pretending to be one\n";
  v.push_back({"text", text, "cannot open"});
  const std::string empty = (dir / "empty.mkv").string();
  std::ofstream(empty).flush();
  v.push_back({"empty", empty, "empty"});
  v.push_back({"directory", dir.string(), "directory"});
  v.push_back({"audio_only", make_video("audio.m4a", "sine=frequency=440:duration=1", "-c:a aac"),
               "audio-only"});
  // Cut at 60%: moov at the front (faststart) → the packets stop early; moov at the end → none.
  const std::string whole = make_video("whole.mp4", "testsrc2=size=64x48:rate=25:duration=4",
                                       "-c:v libx264 -g 10 -pix_fmt yuv420p -movflags +faststart");
  const std::string whole_mkv = (dir / "whole.mkv").string();
  run("ffmpeg -nostdin -v error -y -i '" + whole + "' -c copy '" + whole_mkv + "'");
  const std::string moov_last = (dir / "moov_last.mp4").string();
  run("ffmpeg -nostdin -v error -y -i '" + whole + "' -c copy '" + moov_last + "'");
  const std::string whole_webm = make_video("whole.webm", "testsrc2=size=64x48:rate=25:duration=4",
                                            "-c:v libvpx-vp9 -deadline realtime -g 10");
  const std::string whole_avi =
      make_video("whole.avi", "testsrc2=size=64x48:rate=25:duration=4", "-c:v mpeg4 -g 10");
  for (const auto& [src, name, expect] :
       {std::tuple<std::string, std::string, std::string>{whole, "cut.mp4", "truncated"},
        {whole_mkv, "cut.mkv", "truncated"},
        {whole_webm, "cut.webm", "truncated"},
        {whole_avi, "cut.avi", "truncated"},
        {moov_last, "cut_moov_last.mp4", "cannot open"}}) {
    const std::string cut = (dir / name).string();
    run("head -c $(( $(stat -c %s '" + src + "') * 6 / 10 )) '" + src + "' > '" + cut + "'");
    v.push_back({name, cut, expect});
  }
  return v;
}

TEST(VideoBadInput, LibraryThrowsNamingTheFileAndTheProblem) {
  for (const BadInput& b : bad_inputs()) {
    SampleSpec spec;
    spec.num_frames = 4;
    try {
      decode_video(b.path, spec, {}, keep_size());
      ADD_FAILURE() << b.name << ": no error";
    } catch (const lvx::Error& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(b.path), std::string::npos) << b.name << ": " << msg;
      EXPECT_NE(msg.find(b.expect), std::string::npos) << b.name << ": " << msg;
    }
  }
}

TEST(VideoBadInput, CliExitsNonZeroAndWritesNothing) {
  for (const BadInput& b : bad_inputs()) {
    const std::string out = (temp_dir() / ("bad_" + b.name + ".safetensors")).string();
    int rc = 0;
    const std::string err = run(
        lvx_bin() + " decode --video '" + b.path + "' --num-frames 4 --output '" + out + "' 2>&1",
        &rc);
    EXPECT_EQ(rc, 1) << b.name << ": " << err;
    EXPECT_NE(err.find("error"), std::string::npos) << b.name << ": " << err;
    EXPECT_NE(err.find(b.path), std::string::npos) << b.name << ": " << err;
    EXPECT_FALSE(file_exists(out)) << b.name;
  }
}

TEST(VideoBadInput, TruncatedFileUnderSkipPolicySamplesTheReadablePartAndSaysSo) {
  std::string cut;
  for (const BadInput& b : bad_inputs())
    if (b.name == "cut.mkv") cut = b.path;
  SampleSpec spec;
  spec.num_frames = 5;
  DecodeOptions opt;
  opt.on_corrupt = CorruptPolicy::kSkip;
  const FrameBatch b = decode_video(cut, spec, {}, keep_size(), opt);
  EXPECT_TRUE(b.report.truncated);
  ASSERT_FALSE(b.report.events.empty());
  EXPECT_NE(b.report.events[0].find("truncated"), std::string::npos);
  EXPECT_LT(b.pts[4].item<double>(), 2.5);  // about 60% of 4 s is readable
}

// A damaged packet inside a decodable file: h264 without B-frames, so packet k is frame k.
TEST(VideoBadInput, CorruptFramePolicyErrorSkipRepeat) {
  const std::string good = make_video("corrupt_src.mkv", "testsrc2=size=64x48:rate=25:duration=2",
                                      "-c:v libx264 -g 10 -bf 0 -pix_fmt yuv420p");
  const std::string bad = (temp_dir() / "corrupt.mkv").string();
  run("cp '" + good + "' '" + bad + "'");
  const std::string line =
      run("ffprobe -v error -select_streams v:0 -show_entries "
          "packet=pos,size -of compact=p=0 '" +
          good + "' | sed -n 26p");
  long size = 0, pos = 0;
  ASSERT_EQ(std::sscanf(line.c_str(), "size=%ld|pos=%ld", &size, &pos), 2) << line;
  {
    std::fstream f(bad, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(pos + size / 4);
    // 0xFF bytes: invalid CABAC data the h264 decoder detects (some random patterns decode to
    // garbage it cannot tell from a picture, which no decoder can report).
    for (long i = 0; i < size / 2; ++i) f.put(static_cast<char>(0xFF));
  }
  SampleSpec spec;
  spec.fps = 25;
  DecodeOptions opt;
  try {
    decode_video(bad, spec, {}, keep_size(), opt);
    ADD_FAILURE() << "a corrupt frame passed under the error policy";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("frame 25"), std::string::npos) << e.what();
  }
  opt.on_corrupt = CorruptPolicy::kSkip;
  const FrameBatch skipped = decode_video(bad, spec, {}, keep_size(), opt);
  EXPECT_EQ(skipped.report.skipped, 1);
  EXPECT_EQ(skipped.frames.size(0), 49);
  EXPECT_EQ(skipped.indices[25].item<int64_t>(), 26);
  opt.on_corrupt = CorruptPolicy::kRepeat;
  opt.preprocess_threads = 2;  // the policy is applied in order whatever the consumers' order
  const FrameBatch repeated = decode_video(bad, spec, {}, keep_size(), opt);
  EXPECT_EQ(repeated.report.repeated, 1);
  ASSERT_EQ(repeated.frames.size(0), 50);
  EXPECT_TRUE(at::equal(repeated.frames[25], repeated.frames[24]));
  EXPECT_EQ(repeated.report.events.size(), 1u);
  // The undamaged frames before the damage are untouched.
  const FrameBatch clean = decode_video(good, spec, {}, keep_size());
  EXPECT_TRUE(at::equal(repeated.frames.narrow(0, 0, 25), clean.frames.narrow(0, 0, 25)));
}

// ---------------------------------------------------------------- lvx decode end to end
TEST(VideoCli, DecodeWritesFramesIndicesPtsAndShardsUnion) {
  const std::string path = h264_video();
  const std::string one = (temp_dir() / "one.safetensors").string();
  int rc = 0;
  const std::string log = run(lvx_bin() + " decode --video '" + path +
                                  "' --num-frames 9 --start 0.2 --end 1.8 -o '" + one + "' 2>&1",
                              &rc);
  ASSERT_EQ(rc, 0) << log;
  const TensorFile f = load_safetensors(one);
  SampleSpec spec;
  spec.num_frames = 9;
  spec.start = 0.2;
  spec.end = 1.8;
  const FrameBatch lib = decode_video(path, spec, {}, keep_size());
  EXPECT_TRUE(at::equal(f.tensors.at("frames"), lib.frames));
  EXPECT_TRUE(at::equal(f.tensors.at("indices"), lib.indices));
  EXPECT_TRUE(at::equal(f.tensors.at("pts"), lib.pts));
  EXPECT_EQ(f.metadata.at("num_frames"), "50");
  // stdout: one JSON line describing the run.
  const std::string json_line =
      run(lvx_bin() + " decode --video '" + path + "' --num-frames 9 --start 0.2 --end 1.8 -o '" +
          one + "' 2>/dev/null");
  const nlohmann::json j = nlohmann::json::parse(json_line);
  EXPECT_EQ(j.at("frames").get<int64_t>(), 9);
  EXPECT_EQ(j.at("num_frames").get<int64_t>(), 50);
  EXPECT_EQ(j.at("shard"), nlohmann::json({0, 1, 2, 3, 4, 5, 6, 7, 8}));
  std::vector<at::Tensor> parts, idx;
  for (int r = 0; r < 4; ++r) {
    const std::string out = (temp_dir() / ("r" + std::to_string(r) + ".safetensors")).string();
    run("RANK=" + std::to_string(r) + " WORLD_SIZE=4 " + lvx_bin() + " decode --video '" + path +
        "' --num-frames 9 --start 0.2 --end 1.8 -o '" + out + "' 2>/dev/null");
    const TensorFile part = load_safetensors(out);
    parts.push_back(part.tensors.at("frames"));
    idx.push_back(part.tensors.at("indices"));
  }
  // Rank r holds sampled positions r, r + 4, …: interleaved back, they are the whole.
  EXPECT_TRUE(at::equal(lvx::video::testing::interleave(parts), lib.frames));
  EXPECT_TRUE(at::equal(lvx::video::testing::interleave(idx), lib.indices));
}

TEST(VideoCli, PresetSizeAndNormalize) {
  const std::string path = h264_video();
  const std::string out = (temp_dir() / "norm.safetensors").string();
  int rc = 0;
  const std::string log =
      run(lvx_bin() + " decode --video '" + path +
              "' --fps 2 --preset clip --size 32 --normalize -o '" + out + "' 2>&1",
          &rc);
  ASSERT_EQ(rc, 0) << log;
  const TensorFile f = load_safetensors(out);
  const at::Tensor frames = f.tensors.at("frames");
  EXPECT_EQ(frames.sizes(), (at::IntArrayRef{4, 3, 32, 32}));
  EXPECT_EQ(frames.scalar_type(), at::kFloat);
  PreprocessConfig cfg = PreprocessConfig::clip();
  cfg.image_size = 32;
  cfg.normalize = true;
  SampleSpec spec;
  spec.fps = 2;
  const FrameBatch lib = decode_video(path, spec, {}, cfg);
  EXPECT_TRUE(at::equal(frames, lib.frames));
  // Normalized values lie in the range the mean/std imply.
  EXPECT_LE(frames.max().item<float>(), (1.0f - cfg.mean[2]) / cfg.std[2] + 1e-5f);
}

}  // namespace
}  // namespace lvx::video
