// Helpers for the video tests: make small videos with the ffmpeg CLI into a temp dir, and get
// reference frames and timestamps from ffmpeg/ffprobe (tools nobody here wrote).
#pragma once

#include <ATen/ATen.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace lvx::video::testing {

// Runs a shell command; returns its stdout. Fails the test (and returns "") on a non-zero exit.
inline std::string run(const std::string& cmd, int* rc_out = nullptr) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  if (!f) return out;
  char buf[1 << 16];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  const int status = pclose(f);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc_out)
    *rc_out = rc;
  else
    EXPECT_EQ(rc, 0) << "command failed: " << cmd;
  return out;
}

// A per-process scratch directory, removed after the suite (TempDirCleanup below).
inline const std::filesystem::path& temp_dir() {
  static const std::filesystem::path dir = [] {
    std::string tmpl = (std::filesystem::temp_directory_path() / "lvx_video_XXXXXX").string();
    const char* made = mkdtemp(tmpl.data());
    return std::filesystem::path(made ? made : tmpl);
  }();
  return dir;
}

class TempDirCleanup : public ::testing::Environment {
 public:
  // The frame index cache goes into the scratch directory: tests neither read a stale entry
  // left by another build nor fill the user's cache.
  void SetUp() override { ::setenv("LVX_INDEX_CACHE", (temp_dir() / "index_cache").c_str(), 1); }
  // Not std::filesystem::remove_all: the copy libtorch.so exports wins symbol resolution and
  // crashes (null call) in this build.
  void TearDown() override { std::system(("rm -rf '" + temp_dir().string() + "'").c_str()); }
};
// One registration per binary (inline variable: every test file shares it).
inline ::testing::Environment* const kTempDirCleanup =
    ::testing::AddGlobalTestEnvironment(new TempDirCleanup);

// Encodes `filters` (a lavfi source graph) with `args` into temp_dir()/name, once per process.
// The ranks' shards of a sampled list (video::shard_positions: rank r holds positions r, r + n,
// …) interleaved back into the list's order, along dimension 0.
inline at::Tensor interleave(const std::vector<at::Tensor>& shards) {
  std::vector<at::Tensor> rows;
  int64_t total = 0;
  for (const auto& s : shards) total += s.size(0);
  const int64_t n = static_cast<int64_t>(shards.size());
  for (int64_t p = 0; p < total; ++p) rows.push_back(shards[p % n][p / n]);
  return rows.empty() ? at::cat(shards) : at::stack(rows);
}

inline std::string make_video(const std::string& name, const std::string& source,
                              const std::string& args) {
  const std::string path = (temp_dir() / name).string();
  if (!std::filesystem::exists(path))
    run("ffmpeg -nostdin -v error -y -f lavfi -i '" + source + "' " + args + " '" + path + "'");
  return path;
}

// The sws flags lvx uses, so the CLI conversion is the same one and frames compare exactly.
constexpr const char* kRefScale = "scale=flags=bicubic+accurate_rnd+full_chroma_int";

// Every frame ffmpeg decodes, in output (presentation) order, as RGB24 H×W×3 each. By default
// after ffmpeg's own autorotation (which rotates the YUV planes, then converts); with
// `after_rgb` non-empty, autorotation is off and that filter runs on the RGB frames instead.
inline std::vector<std::vector<uint8_t>> reference_frames(const std::string& path, int64_t w,
                                                          int64_t h,
                                                          const std::string& after_rgb = "") {
  const std::string raw = path + ".rgb";
  run("ffmpeg -nostdin -v error -y " + std::string(after_rgb.empty() ? "" : "-noautorotate ") +
      "-i '" + path + "' -vsync passthrough -vf '" + kRefScale + ",format=rgb24" +
      (after_rgb.empty() ? "" : "," + after_rgb) + "' -f rawvideo '" + raw + "'");
  std::ifstream in(raw, std::ios::binary);
  std::vector<uint8_t> all((std::istreambuf_iterator<char>(in)), {});
  const size_t frame = static_cast<size_t>(w * h * 3);
  std::vector<std::vector<uint8_t>> frames;
  for (size_t off = 0; frame > 0 && off + frame <= all.size(); off += frame)
    frames.emplace_back(all.begin() + off, all.begin() + off + frame);
  return frames;
}

// Rotation in av_display_rotation_get's convention (counter-clockwise degrees) as ffprobe reads
// the display matrix; 0 when there is none.
inline int reference_display_rotation(const std::string& path) {
  const std::string out =
      run("ffprobe -v error -select_streams v:0 -show_entries "
          "stream_side_data=rotation -of csv=p=0 '" +
          path + "'");
  return out.find_first_of("-0123456789") == std::string::npos ? 0 : std::stoi(out);
}

// Presentation timestamps (seconds) of every decoded frame, as ffprobe reports them.
inline std::vector<double> reference_pts(const std::string& path) {
  std::istringstream ss(
      run("ffprobe -v error -select_streams v:0 -show_entries "
          "frame=best_effort_timestamp_time -of csv=p=0 '" +
          path + "'"));
  std::vector<double> pts;
  std::string line;
  // Side data (MPEG-2 in PS) adds empty lines and a trailing comma after the value.
  while (std::getline(ss, line)) {
    line = line.substr(0, line.find(','));
    if (!line.empty() && line != "N/A") pts.push_back(std::stod(line));
  }
  return pts;
}

}  // namespace lvx::video::testing
