// The synthetic long-video QA task (see synthetic_task.h). Randomness comes from SplitMix64
// with our own uniform/integer mappings (not <random>'s distributions, whose output the standard
// leaves to each library), so a seed means the same task everywhere. Each video draws from its
// own generator seeded by (seed, index): threads may encode videos in any order.
#include "tools/synthetic_task.h"

#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <opencv2/imgproc.hpp>
#include <thread>

#include "src/common/error.h"
#include "src/common/files.h"
#include "video/encoder.h"

namespace lvx::tools {

const char* const kColourQuestion = "What colour was the shape that appeared in the video?";
const char* const kShapeQuestion = "What shape appeared in the video?";

const std::vector<std::string>& synthetic_colours() {
  static const std::vector<std::string> c = {"red", "green", "blue", "yellow", "magenta", "cyan"};
  return c;
}

const std::vector<std::string>& synthetic_shapes() {
  static const std::vector<std::string> s = {"square", "circle", "triangle"};
  return s;
}

std::vector<uint8_t> synthetic_colour_rgb(int64_t k) {
  // Saturated (max − min channel >= 170) and far apart in RGB, so a shape stays unmistakable
  // after 4:2:0 chroma subsampling and lossy coding.
  static const uint8_t rgb[6][3] = {{225, 25, 25},  {25, 200, 40},  {35, 60, 235},
                                    {235, 215, 25}, {215, 35, 215}, {25, 205, 220}};
  LVX_CHECK(k >= 0 && k < 6, "synthetic colour index must be in [0, 6), got ", k);
  return {rgb[k][0], rgb[k][1], rgb[k][2]};
}

std::vector<std::string> synthetic_task_words() {
  std::vector<std::string> words = {"user", "assistant"};
  for (const char* q : {kColourQuestion, kShapeQuestion}) {
    std::string w;
    for (const char* p = q;; ++p) {
      if (*p && std::isalpha(static_cast<unsigned char>(*p))) {
        w += *p;
        continue;
      }
      if (!w.empty()) words.push_back(w);
      w.clear();
      if (!*p) break;
    }
  }
  for (const auto& list : {synthetic_colours(), synthetic_shapes()})
    words.insert(words.end(), list.begin(), list.end());
  std::vector<std::string> unique;
  for (const auto& w : words)
    if (std::find(unique.begin(), unique.end(), w) == unique.end()) unique.push_back(w);
  return unique;
}

namespace {

// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and fully specified.
class Rng {
 public:
  explicit Rng(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double uniform(double a, double b) { return a + (b - a) * uniform(); }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t s_;
};

template <typename T>
void shuffle(std::vector<T>* v, Rng* rng) {  // Fisher–Yates
  for (int64_t i = static_cast<int64_t>(v->size()) - 1; i > 0; --i)
    std::swap((*v)[i], (*v)[rng->below(i + 1)]);
}

// What one video shows, drawn before any frame is rendered.
struct VideoPlan {
  std::string id, path;
  int64_t colour = 0, shape = 0;
  int64_t event_first = 0, event_frames = 0;  // frame range of the event
  double cx = 0, cy = 0, half = 0;            // event shape centre and half-size, pixels
  double bg = 0, bg_amp = 0, bg_period = 1, bg_phase = 0;
  struct Distractor {
    bool circle;
    double x, y, vx, vy, r;
    int grey;
  };
  std::vector<Distractor> distractors;
  uint64_t noise_seed = 0;
};

VideoPlan plan_video(const SyntheticTaskSpec& spec, int64_t index, int64_t colour, int64_t shape,
                     int64_t total_frames, int64_t event_frames, const std::string& videos_dir) {
  VideoPlan p;
  char id[32];
  std::snprintf(id, sizeof(id), "synth_%05lld", static_cast<long long>(index));
  p.id = id;
  p.path = videos_dir + "/" + p.id + ".mp4";
  p.colour = colour;
  p.shape = shape;
  Rng rng(Rng(static_cast<uint64_t>(spec.seed) * 0x2545F4914F6CDD1Dull + index).next());
  p.event_frames = event_frames;
  p.event_first = rng.below(total_frames - event_frames + 1);  // uniform over valid starts
  const double s = spec.size;
  p.half = s * rng.uniform(0.22, 0.32);  // a large shape: 44–64 % of the frame side
  p.cx = rng.uniform(p.half + 1, s - p.half - 1);
  p.cy = rng.uniform(p.half + 1, s - p.half - 1);
  p.bg = rng.uniform(90, 160);
  p.bg_amp = rng.uniform(5, 20);
  p.bg_period = rng.uniform(30, 120);
  p.bg_phase = rng.uniform(0, 2 * M_PI);
  const int64_t n = 2 + rng.below(2);
  for (int64_t i = 0; i < n; ++i) {
    VideoPlan::Distractor d;
    d.circle = rng.below(2) == 0;
    d.r = s * rng.uniform(0.06, 0.14);
    d.x = rng.uniform(d.r, s - d.r);
    d.y = rng.uniform(d.r, s - d.r);
    d.vx = rng.uniform(-2, 2);  // pixels per second: slow
    d.vy = rng.uniform(-2, 2);
    d.grey = static_cast<int>(rng.uniform(50, 210));
    p.distractors.push_back(d);
  }
  p.noise_seed = rng.next();
  return p;
}

// Position after `t` seconds of bouncing between lo and hi.
double bounce(double x0, double v, double t, double lo, double hi) {
  const double span = hi - lo;
  if (span <= 0) return lo;
  double u = std::fmod(x0 - lo + v * t, 2 * span);
  if (u < 0) u += 2 * span;
  return lo + (u <= span ? u : 2 * span - u);
}

void render_video(const VideoPlan& p, const SyntheticTaskSpec& spec, int64_t total_frames) {
  const int s = spec.size;
  video::WriterOptions opt;
  opt.keyframe_interval = std::max(1, spec.fps * 6);  // a keyframe every 6 s
  video::VideoWriter w(p.path, s, s, spec.fps, opt);
  cv::Mat frame(s, s, CV_8UC3);
  Rng noise(p.noise_seed);
  const std::vector<uint8_t> c = synthetic_colour_rgb(p.colour);
  const cv::Scalar colour(c[0], c[1], c[2]);  // the Mat holds RGB
  for (int64_t f = 0; f < total_frames; ++f) {
    const double t = static_cast<double>(f) / spec.fps;
    const double bg = p.bg + p.bg_amp * std::sin(2 * M_PI * t / p.bg_period + p.bg_phase);
    frame.setTo(cv::Scalar::all(std::round(bg)));
    for (const auto& d : p.distractors) {
      const cv::Point centre(static_cast<int>(std::lround(bounce(d.x, d.vx, t, d.r, s - d.r))),
                             static_cast<int>(std::lround(bounce(d.y, d.vy, t, d.r, s - d.r))));
      const int r = static_cast<int>(std::lround(d.r));
      if (d.circle)
        cv::circle(frame, centre, r, cv::Scalar::all(d.grey), cv::FILLED, cv::LINE_8);
      else
        cv::rectangle(frame, centre - cv::Point(r, r), centre + cv::Point(r, r),
                      cv::Scalar::all(d.grey), cv::FILLED, cv::LINE_8);
    }
    // Faint luma noise (±3, the same on all channels: grey stays grey). One 64-bit draw serves
    // eight pixels.
    uint8_t* px = frame.data;
    uint64_t bits = 0;
    for (int i = 0; i < s * s; ++i, px += 3) {
      if (i % 8 == 0) bits = noise.next();
      const int delta = static_cast<int>((bits >> (8 * (i % 8))) & 0xFF) % 7 - 3;
      for (int ch = 0; ch < 3; ++ch) px[ch] = cv::saturate_cast<uint8_t>(px[ch] + delta);
    }
    if (f >= p.event_first && f < p.event_first + p.event_frames) {
      const cv::Point ctr(static_cast<int>(std::lround(p.cx)), static_cast<int>(std::lround(p.cy)));
      const int h = static_cast<int>(std::lround(p.half));
      if (p.shape == 0) {
        cv::rectangle(frame, ctr - cv::Point(h, h), ctr + cv::Point(h, h), colour, cv::FILLED,
                      cv::LINE_8);
      } else if (p.shape == 1) {
        cv::circle(frame, ctr, h, colour, cv::FILLED, cv::LINE_8);
      } else {
        const cv::Point tri[3] = {ctr + cv::Point(0, -h), ctr + cv::Point(h, h),
                                  ctr + cv::Point(-h, h)};
        cv::fillConvexPoly(frame, tri, 3, colour, cv::LINE_8);
      }
    }
    // Scene cuts as keyframes: the frame after the event must not inherit a tint of its colour
    // through a predicted frame's residual (measured: saturation up to 41 without this).
    w.write(frame, f == p.event_first || f == p.event_first + p.event_frames);
  }
  w.close();
}

void make_dirs(const std::string& dir) {
  // mkdir -p without std::filesystem (libtorch.so exports broken copies of its symbols).
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0777) != 0 && errno != EEXIST)
      LVX_FAIL("synthetic task: cannot create directory '", prefix, "': ", std::strerror(errno));
  }
  struct stat st {};
  LVX_CHECK(::stat(dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode), "synthetic task: '", dir,
            "' is not a directory");
}

std::string absolute(const std::string& path) {
  char buf[PATH_MAX];
  LVX_CHECK(::realpath(path.c_str(), buf) != nullptr, "synthetic task: cannot resolve '", path,
            "': ", std::strerror(errno));
  return buf;
}

nlohmann::ordered_json row_json(const TaskRow& r) {
  nlohmann::ordered_json j = {{"id", r.id}, {"video", r.video}, {"question", r.question}};
  if (!r.options.empty()) j["options"] = r.options;
  j["answer"] = r.answer;
  j["event_start"] = r.event_start;
  j["event_end"] = r.event_end;
  return j;
}

void write_jsonl(const std::string& path, const std::vector<TaskRow>& rows) {
  const std::string partial = path + ".partial";
  {
    std::ofstream f(partial, std::ios::binary | std::ios::trunc);
    LVX_CHECK(f.is_open(), "synthetic task: cannot create '", partial, "'");
    for (const auto& r : rows) f << row_json(r).dump() << "\n";
    f.flush();
    LVX_CHECK(f.good(), "synthetic task: cannot write '", partial, "'");
  }
  LVX_CHECK(std::rename(partial.c_str(), path.c_str()) == 0, "synthetic task: cannot rename '",
            partial, "' to '", path, "': ", std::strerror(errno));
}

// A video's length and its event's, in frames.
struct FrameCounts {
  int64_t total_frames = 0, event_frames = 0;
};

// The spec checked, and its lengths in frames.
FrameCounts checked_frame_counts(const SyntheticTaskSpec& spec) {
  const char* w = "synthetic task spec: ";
  LVX_CHECK(spec.videos >= 1, w, "videos must be >= 1, got ", spec.videos);
  LVX_CHECK(spec.fps >= 1, w, "fps must be >= 1, got ", spec.fps);
  LVX_CHECK(spec.size >= 16 && spec.size % 2 == 0, w, "size must be even and >= 16 pixels, got ",
            spec.size);
  LVX_CHECK(spec.seconds > 0 && spec.event_seconds > 0, w,
            "seconds and event_seconds must be positive, got ", spec.seconds, " and ",
            spec.event_seconds);
  const int64_t total_frames = std::llround(spec.seconds * spec.fps);
  const int64_t event_frames = std::max<int64_t>(1, std::llround(spec.event_seconds * spec.fps));
  LVX_CHECK(event_frames <= total_frames, w, "event_seconds (", spec.event_seconds,
            ") must not exceed seconds (", spec.seconds, ")");
  LVX_CHECK(spec.test_fraction >= 0 && spec.test_fraction < 1, w,
            "test_fraction must be in [0, 1), got ", spec.test_fraction);
  LVX_CHECK(spec.threads >= 0, w, "threads must be >= 0 (0: one per core), got ", spec.threads);
  return {total_frames, event_frames};
}

// Each video's colour and shape index.
struct Labels {
  std::vector<int64_t> colours, shapes;
};

// Balanced answers: deal the labels round-robin, then shuffle the deal.
Labels deal_labels(const SyntheticTaskSpec& spec) {
  Rng rng(static_cast<uint64_t>(spec.seed));
  const int64_t K = synthetic_colours().size(), S = synthetic_shapes().size();
  std::vector<int64_t> colours(spec.videos), shapes(spec.videos);
  for (int64_t i = 0; i < spec.videos; ++i) {
    colours[i] = i % K;
    shapes[i] = i % S;
  }
  shuffle(&colours, &rng);
  shuffle(&shapes, &rng);
  return {std::move(colours), std::move(shapes)};
}

// Every video's plan, in index order.
std::vector<VideoPlan> plan_videos(const SyntheticTaskSpec& spec, const Labels& labels,
                                   const FrameCounts& counts, const std::string& videos_dir) {
  std::vector<VideoPlan> plans;
  for (int64_t i = 0; i < spec.videos; ++i)
    plans.push_back(plan_video(spec, i, labels.colours[i], labels.shapes[i], counts.total_frames,
                               counts.event_frames, videos_dir));
  return plans;
}

// Encode in parallel; the first error wins and stops the others early.
void render_videos(const std::vector<VideoPlan>& plans, const SyntheticTaskSpec& spec,
                   int64_t total_frames) {
  const int threads = static_cast<int>(std::min<int64_t>(
      spec.threads > 0 ? spec.threads : std::max(1u, std::thread::hardware_concurrency()),
      spec.videos));
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  std::mutex error_mu;
  auto worker = [&] {
    for (int64_t i; !failed && (i = next++) < spec.videos;) {
      try {
        render_video(plans[i], spec, total_frames);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mu);
        if (!error) error = std::current_exception();
        failed = true;
      }
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

// Rows, and the split: the last round(test_fraction · n_c) videos of each colour are held out.
// Returns every row; task->train and task->test get theirs.
std::vector<TaskRow> split_rows(const std::vector<VideoPlan>& plans, const Labels& labels,
                                const SyntheticTaskSpec& spec, SyntheticTask* task) {
  const int64_t K = synthetic_colours().size();
  std::vector<int64_t> per_colour(K, 0), seen(K, 0);
  for (int64_t c : labels.colours) ++per_colour[c];
  std::vector<TaskRow> all;
  for (const VideoPlan& p : plans) {
    TaskRow r;
    r.id = p.id;
    r.video = p.path;
    r.question = kColourQuestion;
    if (spec.multiple_choice) r.options = synthetic_colours();
    r.answer = synthetic_colours()[p.colour];
    r.event_start = static_cast<double>(p.event_first) / spec.fps;
    r.event_end = static_cast<double>(p.event_first + p.event_frames) / spec.fps;
    const int64_t n_test = std::llround(spec.test_fraction * per_colour[p.colour]);
    const bool is_test = seen[p.colour]++ >= per_colour[p.colour] - n_test;
    std::vector<TaskRow> rows = {r};
    if (spec.shape_questions) {
      r.id = p.id + "_shape";
      r.question = kShapeQuestion;
      if (spec.multiple_choice) r.options = synthetic_shapes();
      r.answer = synthetic_shapes()[p.shape];
      rows.push_back(r);
    }
    for (const auto& row : rows) {
      all.push_back(row);
      (is_test ? task->test : task->train).push_back(row);
    }
  }
  return all;
}

// all.jsonl, train.jsonl and test.jsonl written into the task's folder.
void write_task_files(SyntheticTask* task, const std::vector<TaskRow>& all) {
  task->all_jsonl = task->dir + "/all.jsonl";
  task->train_jsonl = task->dir + "/train.jsonl";
  task->test_jsonl = task->dir + "/test.jsonl";
  write_jsonl(task->all_jsonl, all);
  write_jsonl(task->train_jsonl, task->train);
  write_jsonl(task->test_jsonl, task->test);
}

}  // namespace

SyntheticTask generate_synthetic_task(const std::string& dir_in, const SyntheticTaskSpec& spec) {
  const FrameCounts counts = checked_frame_counts(spec);
  make_dirs(dir_in + "/videos");
  SyntheticTask task;
  task.dir = absolute(dir_in);
  const std::string videos_dir = task.dir + "/videos";
  const Labels labels = deal_labels(spec);
  const std::vector<VideoPlan> plans = plan_videos(spec, labels, counts, videos_dir);
  render_videos(plans, spec, counts.total_frames);
  const std::vector<TaskRow> all = split_rows(plans, labels, spec, &task);
  write_task_files(&task, all);
  return task;
}

std::vector<TaskRow> read_task_jsonl(const std::string& path) {
  std::vector<TaskRow> rows;
  // Bounded lines (1 MiB a row) and JSON depth (lvx::for_each_jsonl).
  JsonlOptions opt;
  opt.max_line_bytes = uint64_t{1} << 20;
  for_each_jsonl(
      path, "task file",
      [&](int64_t n, const nlohmann::json& j) {
        const std::string where = lvx::str(path, ":", n);
        LVX_CHECK(j.is_object(), where, ": expected a JSON object per line");
        TaskRow r;
        auto text = [&](const char* field, std::string* out) {
          LVX_CHECK(j.contains(field) && j[field].is_string(), where, ": ", field,
                    ": missing or not a string");
          *out = j[field].get<std::string>();
        };
        text("id", &r.id);
        text("video", &r.video);
        text("question", &r.question);
        text("answer", &r.answer);
        if (j.contains("options")) {
          LVX_CHECK(j["options"].is_array(), where, ": options: expected a list of strings");
          for (const auto& o : j["options"]) {
            LVX_CHECK(o.is_string(), where, ": options: expected strings, got ", o.dump());
            r.options.push_back(o.get<std::string>());
          }
        }
        const std::pair<const char*, double*> times[] = {{"event_start", &r.event_start},
                                                         {"event_end", &r.event_end}};
        for (const auto& [field, out] : times)
          if (j.contains(field)) {
            LVX_CHECK(j[field].is_number(), where, ": ", field, ": expected seconds, got ",
                      j[field].dump());
            *out = j[field].get<double>();
          }
        rows.push_back(std::move(r));
      },
      opt);
  return rows;
}

}  // namespace lvx::tools
