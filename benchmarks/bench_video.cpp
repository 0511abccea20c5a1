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

// The command line: bench_video [--repeat 3] [--threads 1] [--preprocess-threads 1]
// [-o md|jsonl].
struct Settings {
  int repeat = 3, threads = 1, pre_threads = 1;
  std::string fmt = "md";
};

// Reads the flags into `s`; false, after the usage line, on an unknown or incomplete one.
bool parse_flags(int argc, char** argv, Settings& s) {
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--repeat") && i + 1 < argc)
      s.repeat = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc)
      s.threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--preprocess-threads") && i + 1 < argc)
      s.pre_threads = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "-o") && i + 1 < argc)
      s.fmt = argv[++i];
    else {
      std::cerr << "usage: bench_video [--repeat 3] [--threads 1] [--preprocess-threads 1] "
                   "[-o md|jsonl]\n";
      return false;
    }
  }
  return true;
}

// The ffmpeg CLI's thread flag for `s.threads`, spaced to sit between two arguments.
std::string ff_threads(const Settings& s) { return " -threads " + std::to_string(s.threads) + " "; }

// ffmpeg's raw RGB output, thrown away.
const std::string kNullRgb = " -f rawvideo -y /dev/null";

// The videos the workloads read, generated into kDir on first use.
struct Videos {
  std::string clip, minute, hour;
};

Videos make_videos() {
  Videos v;
  v.clip = make("clip_320x240_30s.mp4", "testsrc2=size=320x240:rate=30:duration=30",
                "-c:v libx264 -preset veryfast -g 60 -pix_fmt yuv420p");
  v.minute = make("tiny_1min.mp4", "testsrc=size=64x64:rate=25:duration=60",
                  "-c:v libx264 -preset ultrafast -g 50 -pix_fmt yuv420p");
  v.hour = make("tiny_1hour.mp4", "testsrc=size=64x64:rate=25:duration=3600",
                "-c:v libx264 -preset ultrafast -g 50 -pix_fmt yuv420p");
  return v;
}

// Section 1's shared state: the settings, the clip, lvx's decode and preprocessing settings,
// the sampling specs and the rows timed so far.
struct Throughput {
  Settings s;
  std::string clip;
  DecodeOptions opt;
  PreprocessConfig native, clip224;
  SampleSpec every, two;
  bool have_av = false;
  std::vector<Row> rows;
};

// Native size RGB (no resize) and CLIP 224 normalized to float; every frame and 2 fps.
Throughput make_throughput(const Settings& s, const std::string& clip) {
  Throughput tp;
  tp.s = s;
  tp.clip = clip;
  tp.opt.threads = s.threads;
  tp.opt.preprocess_threads = s.pre_threads;
  tp.native.image_size = 0;
  tp.clip224 = PreprocessConfig::clip();
  tp.clip224.normalize = true;
  tp.every.fps = 30;
  tp.two.fps = 2;
  return tp;
}

// Correctness first: lvx's first 90 frames at native size equal ffmpeg's RGB24 (same swscale
// flags) bit for bit; false, said on stderr, when they differ.
bool frames_equal_ffmpeg(const Throughput& tp) {
  const std::string raw = kDir + "/ref.rgb";
  sh("ffmpeg -nostdin -v error -y -i '" + tp.clip +
     "' -vf 'scale=flags=bicubic+accurate_rnd+full_chroma_int,format=rgb24' -frames:v 90 "
     "-f rawvideo '" +
     raw + "'");
  std::ifstream in(raw, std::ios::binary);
  std::vector<uint8_t> ref((std::istreambuf_iterator<char>(in)), {});
  SampleSpec first3s;
  first3s.fps = 30;
  first3s.end = 3.0;
  const FrameBatch b = decode_video(tp.clip, first3s, {}, tp.native, tp.opt);
  const at::Tensor hwc = b.frames.permute({0, 2, 3, 1}).contiguous();
  if (b.frames.size(0) != 90 || ref.size() != static_cast<size_t>(hwc.numel()) ||
      std::memcmp(ref.data(), hwc.data_ptr<uint8_t>(), ref.size()) != 0) {
    std::cerr << "bench_video: lvx frames differ from ffmpeg's; not timing\n";
    return false;
  }
  std::cerr << "bench_video: correctness: first 90 frames equal ffmpeg's bit for bit\n";
  return true;
}

// Whether kPython imports PyAV (the PyAV rows are skipped without it).
bool python_has_av() { return sh(kPython + " -c 'import av' 2>/dev/null; echo $?") == "0\n"; }

// A row of workload `w`, its ratio lvx's median over this tool's.
void add(Throughput& tp, const std::string& w, const std::string& tool, int64_t frames, Timing t,
         double lvx_median) {
  tp.rows.push_back({w, tool, frames, t, lvx_median / t.median});
}

// PyAV times its own decode loop (interpreter start-up and imports are not counted).
Timing pyav(const Throughput& tp, const std::string& loop) {
  std::vector<double> t;
  for (int i = 0; i <= tp.s.repeat; ++i) {
    int rc = 0;
    const std::string out =
        sh(kPython + " -c \"import av, time; c = av.open('" + tp.clip +
               "'); s = c.streams.video[0]; s.thread_count = " +
               std::to_string(std::max(tp.s.threads, 1)) + "; a = time.perf_counter(); " + loop +
               "; print(time.perf_counter() - a)\"",
           &rc);
    if (rc != 0) throw std::runtime_error("PyAV run failed");
    if (i > 0) t.push_back(std::stod(out));  // the first is the warm-up
  }
  std::sort(t.begin(), t.end());
  return Timing{t[t.size() / 2], t.front(), t.back()};
}

// The ffmpeg CLI decoding the clip through the filter graph `vf` to raw RGB, timed.
Timing time_ffmpeg(const Throughput& tp, const std::string& vf) {
  return time_it(tp.s.repeat, [&] {
    sh("ffmpeg -nostdin -v error" + ff_threads(tp.s) + "-i '" + tp.clip + "' -vf '" + vf + "'" +
       kNullRgb);
  });
}

// lvx decoding the clip with `spec` and `pre`, timed; `*n` gets the frames out.
Timing time_lvx(const Throughput& tp, const SampleSpec& spec, const PreprocessConfig& pre,
                int64_t* n) {
  return time_it(tp.s.repeat,
                 [&] { *n = decode_video(tp.clip, spec, {}, pre, tp.opt).frames.size(0); });
}

// 1a: every frame, native size RGB.
void time_native_rgb(Throughput& tp) {
  int64_t n = 0;
  const Timing l = time_lvx(tp, tp.every, tp.native, &n);
  add(tp, "all frames, RGB24 native", "lvx", n, l, l.median);
  add(tp, "all frames, RGB24 native", "ffmpeg CLI", n,
      time_ffmpeg(tp, "scale=flags=bicubic+accurate_rnd+full_chroma_int,format=rgb24"), l.median);
  if (tp.have_av)
    add(tp, "all frames, RGB24 native", "PyAV", n,
        pyav(tp, "[f.to_ndarray(format='rgb24') for f in c.decode(s)]"), l.median);
}

// 1b: every frame, CLIP preprocessing (shortest edge 224 bicubic, crop, normalize → float).
void time_clip224(Throughput& tp) {
  int64_t n = 0;
  const Timing l = time_lvx(tp, tp.every, tp.clip224, &n);
  add(tp, "all frames + CLIP 224 float", "lvx", n, l, l.median);
  add(tp, "all frames + CLIP 224 float", "ffmpeg CLI (scale+crop, uint8)", n,
      time_ffmpeg(tp, "scale=-2:224:flags=bicubic,crop=224:224,format=rgb24"), l.median);
}

// 1c: 2 fps sampling + CLIP preprocessing: lvx seeks; ffmpeg's fps filter decodes all.
void time_two_fps(Throughput& tp) {
  int64_t n = 0;
  const Timing l = time_lvx(tp, tp.two, tp.clip224, &n);
  add(tp, "2 fps sample + CLIP 224 float", "lvx", n, l, l.median);
  add(tp, "2 fps sample + CLIP 224 float", "ffmpeg CLI (fps=2,scale+crop)", n,
      time_ffmpeg(tp, "fps=2,scale=-2:224:flags=bicubic,crop=224:224,format=rgb24"), l.median);
  if (tp.have_av)
    add(tp, "2 fps sample + CLIP 224 float", "PyAV (decode all, keep 2 fps)", n,
        pyav(tp,
             "[f.to_ndarray(format='rgb24') for i, f in enumerate(c.decode(s)) if i % 15 == 0]"),
        l.median);
}

// Median over `repeat` runs of the child's own decode_video time (in `*wall`); its frames
// decoded, frames in the video and peak RSS, of the last run.
std::array<double, 3> child(const Settings& s, const std::string& path, double* wall) {
  std::vector<double> t;
  double d = 0, n = 0, m = 0, sec = 0;
  for (int i = 0; i < s.repeat; ++i) {
    int rc = 0;
    const std::string out = sh(
        "'" + self_exe() + "' --child-sample60 '" + path + "' " + std::to_string(s.threads), &rc);
    if (rc != 0) throw std::runtime_error("child run failed on " + path);
    std::sscanf(out.c_str(), "%lf %lf %lf %lf", &d, &n, &m, &sec);
    t.push_back(sec);
  }
  std::sort(t.begin(), t.end());
  *wall = t[t.size() / 2];
  return std::array<double, 3>{d, n, m};
}

// The ffmpeg CLI's fps filter taking 60 frames of `path` (`dur` s long) to 384x384 RGB: its
// median wall time and its own maxrss in MiB (-1 when it reports none).
std::pair<double, double> ffmpeg_sample60(const Settings& s, const std::string& path, int dur) {
  std::vector<double> ft;
  std::string err;
  for (int i = 0; i < s.repeat; ++i) {
    const auto a = Clock::now();
    err = sh("ffmpeg -nostdin -benchmark -hide_banner -nostats -v info" + ff_threads(s) + "-i '" +
             path + "' -vf 'fps=60/" + std::to_string(dur) +
             ",scale=384:384:flags=bicubic,format=rgb24' -frames:v 60" + kNullRgb + " 2>&1; true");
    ft.push_back(std::chrono::duration<double>(Clock::now() - a).count());
  }
  std::sort(ft.begin(), ft.end());
  const size_t at = err.find("maxrss=");
  return {ft[ft.size() / 2], at == std::string::npos ? -1 : std::stod(err.substr(at + 7)) / 1024.0};
}

// 2: 60 frames from 1 minute vs 1 hour: time, peak RSS, frames decoded. Each run is a
// fresh process (this binary in child mode; ffmpeg reports its own maxrss with -benchmark).
void print_sample60_table(const Settings& s, const Videos& v) {
  std::printf(
      "\n| video | tool | median s (work only) | peak RSS MiB | frames decoded / in video |\n"
      "|---|---|---|---|---|\n");
  double wall = 0;
  const auto base = child(s, "", &wall);
  std::printf("| (none) | lvx process, libtorch loaded, no work | %.3f | %.1f | - |\n", wall,
              base[2]);
  for (const auto& [name, path, dur] :
       {std::tuple<std::string, std::string, int>{"1 minute", v.minute, 60},
        {"1 hour", v.hour, 3600}}) {
    const auto r = child(s, path, &wall);
    std::printf("| %s | lvx (60 frames, SigLIP 384 uint8) | %.3f | %.1f | %.0f / %.0f |\n",
                name.c_str(), wall, r[2], r[0], r[1]);
    const auto [fw, frss] = ffmpeg_sample60(s, path, dur);
    std::printf("| %s | ffmpeg CLI (fps filter: decodes all) | %.3f | %.1f | all |\n", name.c_str(),
                fw, frss);
  }
}

// The frame index cache of sections 3 and 4 (LVX_INDEX_CACHE).
const std::string kIndexCache = kDir + "/index_cache";

// `world` ranks (child processes started together, each sampling its share of the 60 frames
// of `path` in `layout`), `repeat` times: the median of the slowest rank's time. `*decoded`
// gets the last run's frames decoded, summed over its ranks; cold removes the index cache first.
double ranks_run(const Settings& s, const std::string& path, int world, bool cold, double* decoded,
                 const std::string& layout = "striped") {
  std::vector<double> t;
  for (int i = 0; i < s.repeat; ++i) {
    if (cold) sh("rm -rf '" + kIndexCache + "'");
    std::string cmd = "(";
    for (int r = 0; r < world; ++r)
      cmd += "'" + self_exe() + "' --child-sample60 '" + path + "' " + std::to_string(s.threads) +
             " " + std::to_string(r) + " " + std::to_string(world) + " " + layout + " & ";
    cmd += "wait)";
    const std::string out = sh(cmd);
    double slowest = 0, d = 0, n = 0, m = 0, sec = 0;
    size_t at = 0;
    *decoded = 0;
    for (int r = 0; r < world; ++r) {
      const size_t nl = out.find('\n', at);
      if (nl == std::string::npos) throw std::runtime_error("a rank failed on " + path);
      std::sscanf(out.c_str() + at, "%lf %lf %lf %lf", &d, &n, &m, &sec);
      slowest = std::max(slowest, sec);
      *decoded += d;
      at = nl + 1;
    }
    t.push_back(slowest);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// 3: one index per video. 60 frames (SigLIP 384) from the 1-minute and the 1-hour video on
// 1 and on 4 ranks (4 processes started together, each decoding its 15 frames; time = the
// slowest rank's decode_video), with the frame index cache cold (removed before each run:
// one rank scans, the others wait for it) and warm (every rank reads the index).
void print_index_table(const Settings& s, const Videos& v) {
  std::printf(
      "\n| ranks | index cache | 1 minute s | 1 hour s | hour / minute "
      "|\n|---|---|---|---|---|\n");
  double decoded = 0;
  for (int world : {1, 4})
    for (bool cold : {true, false}) {
      if (!cold)  // fill it
        ranks_run(s, v.minute, world, true, &decoded), ranks_run(s, v.hour, world, true, &decoded);
      const double m = ranks_run(s, v.minute, world, cold, &decoded),
                   h = ranks_run(s, v.hour, world, cold, &decoded);
      std::printf("| %d | %s | %.3f | %.3f | %.2f |\n", world,
                  cold ? "cold (built once per run)" : "warm", m, h, h / m);
    }
}

// 4: what the striped layout costs. The same 60 frames of the 1-hour video on 4 ranks,
// warm index: each rank's 15 frames striped over the hour (positions r, r + 4, …: lvx's
// layout, models::media_layout) or one contiguous quarter (the layout before).
void print_layout_table(const Settings& s, const Videos& v) {
  std::printf(
      "\n| 60 frames of the 1-hour video on 4 ranks | slowest rank s | frames decoded (all ranks) "
      "|\n|---|---|---|\n");
  double decoded = 0;
  ranks_run(s, v.hour, 4, true, &decoded);  // fill the index cache
  for (const std::string layout : {"contiguous", "striped"}) {
    const double t = ranks_run(s, v.hour, 4, false, &decoded, layout);
    std::printf("| %s | %.3f | %.0f |\n", layout.c_str(), t, decoded);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2 && !std::strcmp(argv[1], "--child-sample60"))
    return sample60_child(argc >= 3 ? argv[2] : "", argc >= 4 ? std::atoi(argv[3]) : 1,
                          argc >= 5 ? std::atoi(argv[4]) : 0, argc >= 6 ? std::atoi(argv[5]) : 1,
                          argc >= 7 && !std::strcmp(argv[6], "contiguous"));
  Settings s;
  if (!parse_flags(argc, argv, s)) return 2;
  try {
    sh("mkdir -p " + kDir);
    const Videos v = make_videos();
    Throughput tp = make_throughput(s, v.clip);
    if (!frames_equal_ffmpeg(tp)) return 1;
    tp.have_av = python_has_av();
    time_native_rgb(tp);
    time_clip224(tp);
    time_two_fps(tp);
    print(tp.rows, s.fmt);
    print_sample60_table(s, v);
    ::setenv("LVX_INDEX_CACHE", kIndexCache.c_str(), 1);
    print_index_table(s, v);
    print_layout_table(s, v);
  } catch (const std::exception& e) {
    std::cerr << "bench_video: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
