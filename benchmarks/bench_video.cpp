// bench_video: lvx's video path against the ffmpeg CLI (and PyAV when installed), side by side
// in one run, correctness checked first.
//   1. Throughput (frames/s) for decode + sample + preprocess on a 30 s 320x240 H.264 video:
//      every frame at native size (RGB24), every frame preprocessed (CLIP 224, float), and 2 fps
//      sampling + preprocessing — against `ffmpeg` decoding the same file to the same output,
//      and PyAV decoding to RGB. Ratios are lvx time / baseline time (lower is better for lvx).
//   2. Sampling 60 frames (SigLIP 384) from a 1-minute and a 1-hour video (64x64, 25 fps,
//      2 s GOP): wall time, peak RSS of a process doing only that, frames decoded — against
//      the ffmpeg CLI's `fps` filter, which must decode the whole file.
//   3. One index per video: the same 60 frames on 1 and on 4 ranks (processes), frame index
//      cache cold and warm, and the ratio of the 1-hour time to the 1-minute time.
//   4. The striped layout's cost: 60 frames of the 1-hour video on 4 ranks, each rank's share
//      striped over the hour (lvx's) or a contiguous quarter, slowest rank and frames decoded.
// Videos are generated into /tmp/lvx_bench_video (kept between runs). Usage:
//   bench_video [--repeat 3] [--threads 1] [--preprocess-threads 1] [-o md|jsonl]
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <string>
#include <tuple>
#include <vector>

#include "video/pipeline.h"

namespace {

using namespace lvx::video;
using Clock = std::chrono::steady_clock;

const std::string kDir = "/tmp/lvx_bench_video";
// Python with PyAV for the PyAV rows: $LVX_PYTHON, else python3 (rows are skipped without av).
const std::string kPython = std::getenv("LVX_PYTHON") ? std::getenv("LVX_PYTHON") : "python3";

std::string sh(const std::string& cmd, int* rc = nullptr) {
  std::string out;
  FILE* f = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while (f && (n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
  const int status = f ? pclose(f) : -1;
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc) *rc = code;
  return out;
}

bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 && st.st_size > 0;
}

std::string make(const std::string& name, const std::string& src, const std::string& args) {
  const std::string path = kDir + "/" + name;
  if (!exists(path)) {
    std::cerr << "bench_video: generating " << path << " ...\n";
    int rc = 0;
    sh("ffmpeg -nostdin -v error -y -f lavfi -i '" + src + "' " + args + " '" + path + "'", &rc);
    if (rc != 0) throw std::runtime_error("ffmpeg failed to generate " + path);
  }
  return path;
}

struct Timing {
  double median = 0, min = 0, max = 0;
};

template <typename F>
Timing time_it(int repeat, F&& fn) {
  fn();  // warm-up (page cache, lazy init)
  std::vector<double> t;
  for (int i = 0; i < repeat; ++i) {
    const auto a = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), t.back()};
}

// Peak resident memory of this process (VmHWM, MiB). Read in a freshly exec'd process it
// counts only that process: wait4's ru_maxrss would include the parent's pages copied at fork.
double peak_rss_mib() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return -1;
}

// Child mode: sample 60 frames (SigLIP 384) from `path`; prints "decoded total peak_mib
// seconds" (the time of decode_video alone, without process start-up).
// contiguous: the rank's share is a contiguous run of the 60 sampled positions (the layout lvx
// used before frames were striped) instead of positions rank, rank + world, … (lvx's).
int sample60_child(const std::string& path, int threads, int rank = 0, int world = 1,
                   bool contiguous = false) {
  PreprocessConfig siglip = PreprocessConfig::siglip();
  double decoded = 0, total = 0, seconds = 0;
  const auto a = Clock::now();
  if (!path.empty()) {
    SampleSpec sixty;
    sixty.num_frames = 60;
    DecodeOptions opt;
    opt.threads = threads;
    std::vector<int64_t> run;
    for (int64_t p = 60 * rank / world; p < 60 * (rank + 1) / world; ++p) run.push_back(p);
    const FrameBatch b = contiguous ? decode_positions(path, sixty, run, siglip, opt)
                                    : decode_video(path, sixty, {rank, world}, siglip, opt);
    decoded = static_cast<double>(b.report.stats.frames_decoded);
    total = static_cast<double>(b.info.num_frames);
  }
  seconds = std::chrono::duration<double>(Clock::now() - a).count();
  std::printf("%.0f %.0f %.1f %.4f\n", decoded, total, peak_rss_mib(), seconds);
  return 0;
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  return std::string(buf, n > 0 ? n : 0);
}

struct Row {
  std::string workload, tool;
  int64_t frames;
  Timing t;
  double ratio;  // lvx / this (for baseline rows) or 1 for lvx
};

void print(const std::vector<Row>& rows, const std::string& fmt) {
  if (fmt == "jsonl") {
    for (const Row& r : rows)
      std::printf(
          "{\"workload\":\"%s\",\"tool\":\"%s\",\"frames\":%lld,\"median_s\":%.4f,"
          "\"min_s\":%.4f,\"max_s\":%.4f,\"fps\":%.1f,\"lvx_time_over_tool_time\":%.3f}\n",
          r.workload.c_str(), r.tool.c_str(), static_cast<long long>(r.frames), r.t.median, r.t.min,
          r.t.max, r.frames / r.t.median, r.ratio);
    return;
  }
  std::printf(
      "| workload | tool | frames out | median s (min-max) | frames/s | lvx time / tool time |\n"
      "|---|---|---|---|---|---|\n");
  for (const Row& r : rows)
    std::printf("| %s | %s | %lld | %.3f (%.3f-%.3f) | %.0f | %.2f |\n", r.workload.c_str(),
                r.tool.c_str(), static_cast<long long>(r.frames), r.t.median, r.t.min, r.t.max,
                r.frames / r.t.median, r.ratio);
}

}  // namespace

int main(int argc, char** argv) {
  int repeat = 3, threads = 1, pre_threads = 1;
  std::string fmt = "md";
  if (argc >= 2 && !std::strcmp(argv[1], "--child-sample60"))
    return sample60_child(argc >= 3 ? argv[2] : "", argc >= 4 ? std::atoi(argv[3]) : 1,
                          argc >= 5 ? std::atoi(argv[4]) : 0, argc >= 6 ? std::atoi(argv[5]) : 1,
                          argc >= 7 && !std::strcmp(argv[6], "contiguous"));
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--repeat") && i + 1 < argc)
      repeat = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc)
      threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--preprocess-threads") && i + 1 < argc)
      pre_threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "-o") && i + 1 < argc)
      fmt = argv[++i];
    else {
      std::cerr << "usage: bench_video [--repeat 3] [--threads 1] [--preprocess-threads 1] "
                   "[-o md|jsonl]\n";
      return 2;
    }
  }
  try {
    sh("mkdir -p " + kDir);
    const std::string clip =
        make("clip_320x240_30s.mp4", "testsrc2=size=320x240:rate=30:duration=30",
             "-c:v libx264 -preset veryfast -g 60 -pix_fmt yuv420p");
    const std::string minute = make("tiny_1min.mp4", "testsrc=size=64x64:rate=25:duration=60",
                                    "-c:v libx264 -preset ultrafast -g 50 -pix_fmt yuv420p");
    const std::string hour = make("tiny_1hour.mp4", "testsrc=size=64x64:rate=25:duration=3600",
                                  "-c:v libx264 -preset ultrafast -g 50 -pix_fmt yuv420p");
    DecodeOptions opt;
    opt.threads = threads;
    opt.preprocess_threads = pre_threads;
    const std::string ff_threads = " -threads " + std::to_string(threads) + " ";
    PreprocessConfig native;
    native.image_size = 0;
    PreprocessConfig clip224 = PreprocessConfig::clip();
    clip224.normalize = true;
    SampleSpec every;
    every.fps = 30;
    SampleSpec two;
    two.fps = 2;

    // ---- correctness first: lvx frames equal ffmpeg's (same swscale flags), sampled subset.
    {
      const std::string raw = kDir + "/ref.rgb";
      sh("ffmpeg -nostdin -v error -y -i '" + clip +
         "' -vf 'scale=flags=bicubic+accurate_rnd+full_chroma_int,format=rgb24' -frames:v 90 "
         "-f rawvideo '" +
         raw + "'");
      std::ifstream in(raw, std::ios::binary);
      std::vector<uint8_t> ref((std::istreambuf_iterator<char>(in)), {});
      SampleSpec first3s;
      first3s.fps = 30;
      first3s.end = 3.0;
      const FrameBatch b = decode_video(clip, first3s, {}, native, opt);
      const at::Tensor hwc = b.frames.permute({0, 2, 3, 1}).contiguous();
      if (b.frames.size(0) != 90 || ref.size() != static_cast<size_t>(hwc.numel()) ||
          std::memcmp(ref.data(), hwc.data_ptr<uint8_t>(), ref.size()) != 0) {
        std::cerr << "bench_video: lvx frames differ from ffmpeg's; not timing\n";
        return 1;
      }
      std::cerr << "bench_video: correctness: first 90 frames equal ffmpeg's bit for bit\n";
    }

    std::vector<Row> rows;
    const std::string null_rgb = " -f rawvideo -y /dev/null";
    const bool have_av = sh(kPython + " -c 'import av' 2>/dev/null; echo $?") == "0\n";
    auto add = [&](const std::string& w, const std::string& tool, int64_t frames, Timing t,
                   double lvx_median) {
      rows.push_back({w, tool, frames, t, lvx_median / t.median});
    };
    // PyAV times its own decode loop (interpreter start-up and imports are not counted).
    auto pyav = [&](const std::string& loop) {
      std::vector<double> t;
      for (int i = 0; i <= repeat; ++i) {
        int rc = 0;
        const std::string out =
            sh(kPython + " -c \"import av, time; c = av.open('" + clip +
                   "'); s = c.streams.video[0]; s.thread_count = " +
                   std::to_string(std::max(threads, 1)) + "; a = time.perf_counter(); " + loop +
                   "; print(time.perf_counter() - a)\"",
               &rc);
        if (rc != 0) throw std::runtime_error("PyAV run failed");
        if (i > 0) t.push_back(std::stod(out));  // the first is the warm-up
      }
      std::sort(t.begin(), t.end());
      return Timing{t[t.size() / 2], t.front(), t.back()};
    };

    // 1a: every frame, native size RGB.
    {
      int64_t n = 0;
      const Timing l =
          time_it(repeat, [&] { n = decode_video(clip, every, {}, native, opt).frames.size(0); });
      add("all frames, RGB24 native", "lvx", n, l, l.median);
      add("all frames, RGB24 native", "ffmpeg CLI", n,
          time_it(repeat,
                  [&] {
                    sh("ffmpeg -nostdin -v error" + ff_threads + "-i '" + clip +
                       "' -vf 'scale=flags=bicubic+accurate_rnd+full_chroma_int,format=rgb24'" +
                       null_rgb);
                  }),
          l.median);
      if (have_av)
        add("all frames, RGB24 native", "PyAV", n,
            pyav("[f.to_ndarray(format='rgb24') for f in c.decode(s)]"), l.median);
    }
    // 1b: every frame, CLIP preprocessing (shortest edge 224 bicubic, crop, normalize → float).
    {
      int64_t n = 0;
      const Timing l =
          time_it(repeat, [&] { n = decode_video(clip, every, {}, clip224, opt).frames.size(0); });
      add("all frames + CLIP 224 float", "lvx", n, l, l.median);
      add("all frames + CLIP 224 float", "ffmpeg CLI (scale+crop, uint8)", n,
          time_it(repeat,
                  [&] {
                    sh("ffmpeg -nostdin -v error" + ff_threads + "-i '" + clip +
                       "' -vf 'scale=-2:224:flags=bicubic,crop=224:224,format=rgb24'" + null_rgb);
                  }),
          l.median);
    }
    // 1c: 2 fps sampling + CLIP preprocessing: lvx seeks; ffmpeg's fps filter decodes all.
    {
      int64_t n = 0;
      const Timing l =
          time_it(repeat, [&] { n = decode_video(clip, two, {}, clip224, opt).frames.size(0); });
      add("2 fps sample + CLIP 224 float", "lvx", n, l, l.median);
      add("2 fps sample + CLIP 224 float", "ffmpeg CLI (fps=2,scale+crop)", n,
          time_it(repeat,
                  [&] {
                    sh("ffmpeg -nostdin -v error" + ff_threads + "-i '" + clip +
                       "' -vf 'fps=2,scale=-2:224:flags=bicubic,crop=224:224,format=rgb24'" +
                       null_rgb);
                  }),
          l.median);
      if (have_av)
        add("2 fps sample + CLIP 224 float", "PyAV (decode all, keep 2 fps)", n,
            pyav(
                "[f.to_ndarray(format='rgb24') for i, f in enumerate(c.decode(s)) if i % 15 == 0]"),
            l.median);
    }
    print(rows, fmt);

    // 2: 60 frames from 1 minute vs 1 hour: time, peak RSS, frames decoded. Each run is a
    // fresh process (this binary in child mode; ffmpeg reports its own maxrss with -benchmark).
    std::printf(
        "\n| video | tool | median s (work only) | peak RSS MiB | frames decoded / in video |\n"
        "|---|---|---|---|---|\n");
    // Median over `repeat` runs of the child's own decode_video time; peak RSS of the last.
    auto child = [&](const std::string& path, double* wall) {
      std::vector<double> t;
      double d = 0, n = 0, m = 0, s = 0;
      for (int i = 0; i < repeat; ++i) {
        int rc = 0;
        const std::string out = sh(
            "'" + self_exe() + "' --child-sample60 '" + path + "' " + std::to_string(threads), &rc);
        if (rc != 0) throw std::runtime_error("child run failed on " + path);
        std::sscanf(out.c_str(), "%lf %lf %lf %lf", &d, &n, &m, &s);
        t.push_back(s);
      }
      std::sort(t.begin(), t.end());
      *wall = t[t.size() / 2];
      return std::array<double, 3>{d, n, m};
    };
    double wall = 0;
    const auto base = child("", &wall);
    std::printf("| (none) | lvx process, libtorch loaded, no work | %.3f | %.1f | - |\n", wall,
                base[2]);
    for (const auto& [name, path, dur] :
         {std::tuple<std::string, std::string, int>{"1 minute", minute, 60},
          {"1 hour", hour, 3600}}) {
      const auto r = child(path, &wall);
      std::printf("| %s | lvx (60 frames, SigLIP 384 uint8) | %.3f | %.1f | %.0f / %.0f |\n",
                  name.c_str(), wall, r[2], r[0], r[1]);
      std::vector<double> ft;
      std::string err;
      for (int i = 0; i < repeat; ++i) {
        const auto a = Clock::now();
        err = sh("ffmpeg -nostdin -benchmark -hide_banner -nostats -v info" + ff_threads + "-i '" +
                 path + "' -vf 'fps=60/" + std::to_string(dur) +
                 ",scale=384:384:flags=bicubic,format=rgb24' -frames:v 60" + null_rgb +
                 " 2>&1; true");
        ft.push_back(std::chrono::duration<double>(Clock::now() - a).count());
      }
      std::sort(ft.begin(), ft.end());
      const double fw = ft[ft.size() / 2];
      const size_t at = err.find("maxrss=");
      const double frss = at == std::string::npos ? -1 : std::stod(err.substr(at + 7)) / 1024.0;
      std::printf("| %s | ffmpeg CLI (fps filter: decodes all) | %.3f | %.1f | all |\n",
                  name.c_str(), fw, frss);
    }
    // 3: one index per video. 60 frames (SigLIP 384) from the 1-minute and the 1-hour video on
    // 1 and on 4 ranks (4 processes started together, each decoding its 15 frames; time = the
    // slowest rank's decode_video), with the frame index cache cold (removed before each run:
    // one rank scans, the others wait for it) and warm (every rank reads the index).
    std::printf(
        "\n| ranks | index cache | 1 minute s | 1 hour s | hour / minute "
        "|\n|---|---|---|---|---|\n");
    const std::string cache = kDir + "/index_cache";
    ::setenv("LVX_INDEX_CACHE", cache.c_str(), 1);
    double decoded_frames = 0;  // of the last run, summed over its ranks
    auto ranks_run = [&](const std::string& path, int world, bool cold,
                         const std::string& layout = "striped") {
      std::vector<double> t;
      for (int i = 0; i < repeat; ++i) {
        if (cold) sh("rm -rf '" + cache + "'");
        std::string cmd = "(";
        for (int r = 0; r < world; ++r)
          cmd += "'" + self_exe() + "' --child-sample60 '" + path + "' " + std::to_string(threads) +
                 " " + std::to_string(r) + " " + std::to_string(world) + " " + layout + " & ";
        cmd += "wait)";
        const std::string out = sh(cmd);
        double slowest = 0, d = 0, n = 0, m = 0, s = 0;
        size_t at = 0;
        decoded_frames = 0;
        for (int r = 0; r < world; ++r) {
          const size_t nl = out.find('\n', at);
          if (nl == std::string::npos) throw std::runtime_error("a rank failed on " + path);
          std::sscanf(out.c_str() + at, "%lf %lf %lf %lf", &d, &n, &m, &s);
          slowest = std::max(slowest, s);
          decoded_frames += d;
          at = nl + 1;
        }
        t.push_back(slowest);
      }
      std::sort(t.begin(), t.end());
      return t[t.size() / 2];
    };
    for (int world : {1, 4})
      for (bool cold : {true, false}) {
        if (!cold) ranks_run(minute, world, true), ranks_run(hour, world, true);  // fill it
        const double m = ranks_run(minute, world, cold), h = ranks_run(hour, world, cold);
        std::printf("| %d | %s | %.3f | %.3f | %.2f |\n", world,
                    cold ? "cold (built once per run)" : "warm", m, h, h / m);
      }
    // 4: what the striped layout costs. The same 60 frames of the 1-hour video on 4 ranks,
    // warm index: each rank's 15 frames striped over the hour (positions r, r + 4, …: lvx's
    // layout, models::media_layout) or one contiguous quarter (the layout before).
    std::printf(
        "\n| 60 frames of the 1-hour video on 4 ranks | slowest rank s | frames decoded (all ranks) "
        "|\n|---|---|---|\n");
    ranks_run(hour, 4, true);  // fill the index cache
    for (const std::string layout : {"contiguous", "striped"}) {
      const double t = ranks_run(hour, 4, false, layout);
      std::printf("| %s | %.3f | %.0f |\n", layout.c_str(), t, decoded_frames);
    }
  } catch (const std::exception& e) {
    std::cerr << "bench_video: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
