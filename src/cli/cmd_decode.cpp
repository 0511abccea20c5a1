// `lvx decode`: one rank's share of a video → frames.safetensors (frames [N,3,H,W], indices,
// pts). Sampling, colour, rotation and bad-input rules: docs/video.md.
#include <cmath>
#include <cstdlib>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"
#include "video/pipeline.h"

namespace {

using namespace lvx::video;

// Flag, else torchrun's variable, else the default.
int64_t rank_setting(const lvx::cli::ArgParser& p, const char* flag, const char* env,
                     int64_t fallback) {
  if (!p.get(flag).empty()) return p.get_int(flag);
  if (const char* v = std::getenv(env)) {
    try {
      return std::stoll(v);
    } catch (...) {
      LVX_FAIL("environment variable ", env, " must be an integer, got '", v, "'");
    }
  }
  return fallback;
}

std::array<float, 3> three_floats(const lvx::cli::ArgParser& p, const std::string& name) {
  const auto parts = p.get_list(name);
  LVX_CHECK(parts.size() == 3, "--", name, " expects three comma-separated numbers, got '",
            p.get(name), "'");
  std::array<float, 3> v{};
  for (int i = 0; i < 3; ++i) {
    size_t pos = 0;
    try {
      v[i] = std::stof(parts[i], &pos);
    } catch (...) {
      LVX_FAIL("--", name, " expects numbers, got '", parts[i], "'");
    }
    LVX_CHECK(pos == parts[i].size() && std::isfinite(v[i]), "--", name,
              " expects finite numbers, got '", parts[i], "'");
  }
  return v;
}

void add_decode_options(lvx::cli::ArgParser& p) {
  p.add_option("video", 'v', "", "input video file", true);
  p.add_option("output", 'o', "", "output .safetensors file (written atomically)", true);
  p.add_option("fps", 'f', "", "sample at this many frames per second (timestamps start + k/F)");
  p.add_option("num-frames", 'n', "", "sample N frames uniformly over [start, end], ends included");
  p.add_option("start", 's', "",
               "range start in seconds of player time (0 = the first displayed frame)");
  p.add_option("end", 'e', "", "range end in seconds, exclusive (default: end of the video)");
  p.add_option("preset", 0, "",
               "preprocessing of a vision tower: siglip (384, squash, mean/std "
               "0.5) or clip (224, shortest edge + centre crop, CLIP mean/std)");
  p.add_option("size", 0, "", "output side P (P×P); overrides the preset's");
  p.add_option("resize", 0, "", "squash | shortest-edge | pad (default: the preset's, or squash)");
  p.add_option("mean", 0, "", "normalization mean r,g,b (default: the preset's)");
  p.add_option("std", 0, "", "normalization std r,g,b (default: the preset's)");
  p.add_flag("normalize", 0, "write float32 (x/255 - mean)/std instead of uint8");
  p.add_option("rank", 'r', "", "this rank (default: $RANK, else 0)");
  p.add_option("world", 'w', "", "number of ranks (default: $WORLD_SIZE, else 1)");
  p.add_option("threads", 't', "1", "FFmpeg decoder threads (0: FFmpeg chooses, one per core)");
  p.add_option("queue", 0, "4", "decoded frames buffered between decoder and preprocessing");
  p.add_option("preprocess-threads", 0, "1", "threads resizing/normalizing decoded frames");
  p.add_option("on-corrupt", 0, "error", "damaged frames or truncated file: error | skip | repeat");
  p.add_flag("no-index-cache", 0,
             "scan the packets instead of reading/writing the frame index cache "
             "($LVX_INDEX_CACHE, else ~/.cache/lvx/index)");
}

SampleSpec sample_spec_of(const lvx::cli::ArgParser& p) {
  SampleSpec spec;
  LVX_CHECK(p.get("fps").empty() != p.get("num-frames").empty(),
            "give exactly one of --fps and --num-frames");
  if (!p.get("fps").empty()) spec.fps = p.get_double("fps");
  if (!p.get("num-frames").empty()) spec.num_frames = p.get_int("num-frames");
  if (!p.get("start").empty()) spec.start = p.get_double("start");
  if (!p.get("end").empty()) spec.end = p.get_double("end");
  return spec;
}

PreprocessConfig preprocess_of(const lvx::cli::ArgParser& p) {
  PreprocessConfig pre;
  pre.image_size = 0;  // keep the displayed size unless asked
  pre.mean = {0.5f, 0.5f, 0.5f};
  pre.std = {0.5f, 0.5f, 0.5f};
  if (!p.get("preset").empty()) pre = PreprocessConfig::preset(p.get("preset"));
  if (!p.get("size").empty()) pre.image_size = p.get_int("size", 1, kMaxImageSize);
  if (!p.get("resize").empty()) pre.resize = parse_resize_mode(p.get("resize"));
  if (!p.get("mean").empty()) pre.mean = three_floats(p, "mean");
  if (!p.get("std").empty()) pre.std = three_floats(p, "std");
  for (float s : pre.std) LVX_CHECK(s > 0, "--std values must be > 0, got ", s);
  pre.normalize = p.flag("normalize");
  return pre;
}

DecodeOptions decode_options_of(const lvx::cli::ArgParser& p) {
  DecodeOptions opt;
  opt.threads = static_cast<int>(p.get_int("threads", 0, kMaxDecodeThreads));
  opt.queue_capacity = static_cast<int>(p.get_int("queue", 1, kMaxQueueCapacity));
  opt.preprocess_threads = static_cast<int>(p.get_int("preprocess-threads", 1, kMaxDecodeThreads));
  opt.on_corrupt = parse_corrupt_policy(p.get("on-corrupt"));
  opt.index_cache = !p.flag("no-index-cache");
  return opt;
}

std::string exact(double x) {
  std::ostringstream o;
  o << std::setprecision(17) << x;
  return o.str();
}

// The file's metadata: the video, the share and how it was decoded.
std::map<std::string, std::string> frames_metadata(const std::string& video, const FrameBatch& b,
                                                   const ShardSpec& shard,
                                                   const PreprocessConfig& pre,
                                                   const DecodeOptions& opt) {
  const VideoInfo& i = b.info;
  return {
      {"video", video},
      {"codec", i.codec},
      {"width", std::to_string(i.width)},
      {"height", std::to_string(i.height)},
      {"rotation", std::to_string(i.rotation)},
      {"num_frames", std::to_string(i.num_frames)},
      {"average_fps", exact(i.average_fps)},
      {"duration_seconds", exact(i.duration_seconds)},
      {"start_pts_seconds", exact(i.begin_seconds)},
      {"rank", std::to_string(shard.rank)},
      {"world", std::to_string(shard.world)},
      {"sampled_total", std::to_string(b.report.sampled_total)},
      {"shard_positions", nlohmann::json(b.report.shard).dump()},
      {"skipped", std::to_string(b.report.skipped)},
      {"repeated", std::to_string(b.report.repeated)},
      {"truncated", b.report.truncated ? "true" : "false"},
      {"on_corrupt", to_string(opt.on_corrupt)},
      {"preprocess", pre.image_size > 0 ? lvx::str(pre.image_size, " ", to_string(pre.resize))
                                        : std::string("none")},
      {"normalized", pre.normalize ? "true" : "false"},
  };
}

// One machine-readable line on stdout (progress and problems went to stderr).
nlohmann::json summary_line(const std::string& video, const std::string& output,
                            const FrameBatch& b, const ShardSpec& shard) {
  const VideoInfo& i = b.info;
  return {{"video", video},
          {"output", output},
          {"rank", shard.rank},
          {"world", shard.world},
          {"frames", b.frames.size(0)},
          {"sampled_total", b.report.sampled_total},
          {"shard", b.report.shard},
          {"num_frames", i.num_frames},
          {"average_fps", i.average_fps},
          {"duration_seconds", i.duration_seconds},
          {"start_pts_seconds", i.begin_seconds},
          {"index_from_cache", i.index_from_cache},
          {"width", i.width},
          {"height", i.height},
          {"rotation", i.rotation},
          {"frames_decoded", b.report.stats.frames_decoded},
          {"seeks", b.report.stats.seeks},
          {"skipped", b.report.skipped},
          {"repeated", b.report.repeated},
          {"truncated", b.report.truncated},
          {"events", b.report.events}};
}

int cmd_decode(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx decode --video V (--fps F | --num-frames N) [--start S] [--end E]\n"
      "           [--preset siglip|clip] [--size P] [--normalize] [--rank r --world n]\n"
      "           [--threads T] [--on-corrupt error|skip|repeat] --output frames.safetensors",
      "Decode this rank's share of the frames sampled from a video (positions rank,\n"
      "rank + world, ...: the model's layout of whole images) and write\n"
      "frames [N,3,H,W] (uint8 RGB, or float32 with --normalize), int64 indices, float64\n"
      "pts (seconds since the first displayed frame, as players count) and stream_pts (the\n"
      "stream's own pts, seconds). Frames are shown as a player shows them (rotation applied). "
      "Without\n"
      "--size or --preset they keep their displayed size. Rank and world default to torchrun's\n"
      "RANK and WORLD_SIZE.");
  add_decode_options(p);
  if (!p.parse(argc, argv)) return 0;
  const SampleSpec spec = sample_spec_of(p);
  const PreprocessConfig pre = preprocess_of(p);
  ShardSpec shard;
  shard.rank = rank_setting(p, "rank", "RANK", 0);
  shard.world = rank_setting(p, "world", "WORLD_SIZE", 1);
  const DecodeOptions opt = decode_options_of(p);

  const std::string video = p.get("video"), output = p.get("output");
  lvx::check_output_path(output, "output file (--output)");
  FrameBatch b = decode_video(video, spec, shard, pre, opt);
  for (const auto& e : b.report.events) std::cerr << "lvx decode: " << video << ": " << e << "\n";
  lvx::save_safetensors(
      output,
      {{"frames", b.frames}, {"indices", b.indices}, {"pts", b.pts}, {"stream_pts", b.stream_pts}},
      frames_metadata(video, b, shard, pre, opt));
  std::cerr << "lvx decode: " << video << ": rank " << shard.rank << "/" << shard.world << " wrote "
            << b.frames.size(0) << " of " << b.report.sampled_total << " sampled frames "
            << b.frames.sizes() << " to " << output << " (decoded " << b.report.stats.frames_decoded
            << " of " << b.info.num_frames << " frames, " << b.report.stats.seeks << " seeks)\n";
  std::cout << summary_line(video, output, b, shard).dump() << std::endl;
  return 0;
}

}  // namespace

LVX_COMMAND("decode", "decode this rank's share of sampled video frames to safetensors",
            cmd_decode);
