// The synthetic long-video QA task: determinism, balanced answers and splits, and, decoding the
// videos with the ffmpeg CLI (not lvx's decoder), that the pixels say what the JSONL says: the
// event frames hold a large shape of the stated colour (classified by hue with this file's own
// table, not the generator's palette) and of the stated shape, and no other frame holds any
// saturated pixel.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include "src/common/error.h"
#include "tests/video_test_util.h"
#include "tools/synthetic_task.h"

namespace lvx::runtime {
namespace {

using namespace lvx::tools;  // the synthetic task (tools/synthetic_task.h)

using video::testing::reference_frames;
using video::testing::run;
using video::testing::temp_dir;

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  for (size_t p = 0; (p = s.find(from, p)) != std::string::npos; p += to.size())
    s.replace(p, from.size(), to);
  return s;
}

SyntheticTaskSpec small_spec() {
  SyntheticTaskSpec s;
  s.videos = 12;
  s.seconds = 30;
  s.event_seconds = 4;
  s.seed = 7;
  s.shape_questions = true;
  s.multiple_choice = true;
  return s;
}

TEST(SyntheticTask, SameSeedGivesIdenticalFilesWhateverTheThreads) {
  const std::string a = (temp_dir() / "det_a").string(), b = (temp_dir() / "det_b").string();
  SyntheticTaskSpec spec = small_spec();
  spec.threads = 2;
  const SyntheticTask ta = generate_synthetic_task(a, spec);
  const std::string first = slurp(ta.all_jsonl);
  const std::string first_video = slurp(ta.train[0].video);
  // Again into the same directory: byte-identical JSONL and videos.
  generate_synthetic_task(a, spec);
  EXPECT_EQ(slurp(ta.all_jsonl), first);
  EXPECT_EQ(slurp(ta.train[0].video), first_video);
  EXPECT_FALSE(first_video.empty());
  // One thread, another directory: the same apart from the directory in the paths.
  spec.threads = 1;
  const SyntheticTask tb = generate_synthetic_task(b, spec);
  EXPECT_EQ(replace_all(slurp(tb.all_jsonl), tb.dir, ta.dir), first);
  for (const auto& r : ta.train)
    EXPECT_EQ(slurp(r.video), slurp(replace_all(r.video, ta.dir, tb.dir))) << r.id;
  // Another seed: another task.
  spec.seed = 8;
  const SyntheticTask tc = generate_synthetic_task((temp_dir() / "det_c").string(), spec);
  EXPECT_NE(replace_all(slurp(tc.all_jsonl), tc.dir, ta.dir), first);
}

TEST(SyntheticTask, AnswersAndSplitsAreBalancedAndFilesAgree) {
  SyntheticTaskSpec spec = small_spec();
  spec.videos = 60;
  spec.seconds = 10;
  spec.event_seconds = 3;
  spec.test_fraction = 0.25;
  const SyntheticTask t = generate_synthetic_task((temp_dir() / "balance").string(), spec);
  EXPECT_EQ(t.dir.front(), '/');
  const std::vector<TaskRow> all = read_task_jsonl(t.all_jsonl);
  ASSERT_EQ(all.size(), 120u);  // a colour and a shape question per video
  std::map<std::string, int> colour_train, colour_test, shape_all;
  std::set<std::string> train_videos, test_videos, ids;
  struct Split {
    const std::vector<TaskRow>* rows;
    std::string file;
    std::set<std::string>* videos;
  };
  for (const auto& [rows, file, videos] : {Split{&t.train, t.train_jsonl, &train_videos},
                                           Split{&t.test, t.test_jsonl, &test_videos}}) {
    const std::vector<TaskRow> read = read_task_jsonl(file);
    ASSERT_EQ(read.size(), rows->size());
    for (size_t i = 0; i < read.size(); ++i) {
      const TaskRow& r = read[i];
      EXPECT_EQ(r.id, (*rows)[i].id);
      EXPECT_EQ(r.answer, (*rows)[i].answer);
      EXPECT_TRUE(ids.insert(r.id).second) << "duplicate id " << r.id;
      videos->insert(r.video);
      EXPECT_EQ(r.video.front(), '/') << "video paths are absolute";
      EXPECT_NE(std::find(r.options.begin(), r.options.end(), r.answer), r.options.end());
      EXPECT_NEAR(r.event_end - r.event_start, spec.event_seconds, 1e-9);
      EXPECT_GE(r.event_start, 0);
      EXPECT_LE(r.event_end, spec.seconds);
      if (r.question == kColourQuestion)
        ++(rows == &t.train ? colour_train : colour_test)[r.answer];
      else
        ++shape_all[r.answer];
    }
  }
  for (const auto& v : test_videos) EXPECT_EQ(train_videos.count(v), 0u) << v << " in both";
  // 60 videos, 6 colours: 10 each; a quarter of 10 is 2.5, rounded to 3 held out per colour.
  for (const auto& c : synthetic_colours()) {
    EXPECT_EQ(colour_train[c], 7) << c;
    EXPECT_EQ(colour_test[c], 3) << c;
  }
  for (const auto& s : synthetic_shapes()) EXPECT_EQ(shape_all[s], 20) << s;
  // Event starts spread over the video rather than sitting in one place.
  std::set<double> starts;
  for (const auto& r : all) starts.insert(r.event_start);
  EXPECT_GT(starts.size(), 10u);
}

// Saturation (max − min channel) and hue in degrees of an RGB pixel.
int saturation(const uint8_t* p) {
  return std::max({p[0], p[1], p[2]}) - std::min({p[0], p[1], p[2]});
}
double hue(double r, double g, double b) {
  const double mx = std::max({r, g, b}), mn = std::min({r, g, b}), d = mx - mn;
  double h = mx == r ? std::fmod((g - b) / d, 6.0) : mx == g ? (b - r) / d + 2 : (r - g) / d + 4;
  h *= 60;
  return h < 0 ? h + 360 : h;
}
std::string colour_name(double h) {  // the six colours' nominal hues
  static const std::pair<double, const char*> names[] = {
      {0, "red"},    {60, "yellow"},   {120, "green"}, {180, "cyan"},
      {240, "blue"}, {300, "magenta"}, {360, "red"}};
  const char* best = "?";
  double dist = 1e9;
  for (const auto& [nominal, name] : names)
    if (std::abs(h - nominal) < dist) dist = std::abs(h - nominal), best = name;
  return dist < 25 ? best : "?";
}

// A pixel counts as saturated above this. Outside the events the measured maximum is 0 (grey
// content, and the generator codes the frames at the event's cuts as keyframes; without that, a
// tint of up to 41 leaked into the frame after the event). The event colours have saturation
// >= 170 and keep well above this after coding except right at a shape's edge.
constexpr int kSaturated = 30;

TEST(SyntheticTask, PixelsDecodedByFfmpegShowTheStatedEventOnlyDuringIt) {
  const SyntheticTaskSpec spec = small_spec();
  const SyntheticTask t = generate_synthetic_task((temp_dir() / "pixels").string(), spec);
  const std::vector<TaskRow> rows = read_task_jsonl(t.all_jsonl);
  std::map<std::string, std::string> shape_of;
  for (const auto& r : rows)
    if (r.question == kShapeQuestion) shape_of[r.video] = r.answer;
  int checked = 0, max_outside = 0;
  for (const auto& r : rows) {
    if (r.question != kColourQuestion) continue;
    EXPECT_EQ(run("ffprobe -v error -select_streams v:0 -show_entries stream=width,height,"
                  "r_frame_rate -of csv=p=0 '" +
                  r.video + "'"),
              "48,48,2/1\n");
    const auto frames = reference_frames(r.video, spec.size, spec.size);
    ASSERT_EQ(frames.size(), static_cast<size_t>(spec.seconds * spec.fps)) << r.video;
    for (size_t i = 0; i < frames.size(); ++i) {
      const double ts = static_cast<double>(i) / spec.fps;
      const bool in_event = ts >= r.event_start && ts < r.event_end;
      const uint8_t* px = frames[i].data();
      int n_sat = 0, x0 = 1 << 20, x1 = -1, y0 = 1 << 20, y1 = -1;
      double sr = 0, sg = 0, sb = 0;
      for (int y = 0; y < spec.size; ++y)
        for (int x = 0; x < spec.size; ++x, px += 3) {
          const int s = saturation(px);
          if (!in_event) max_outside = std::max(max_outside, s);
          if (s <= kSaturated) continue;
          ++n_sat;
          sr += px[0], sg += px[1], sb += px[2];
          x0 = std::min(x0, x), x1 = std::max(x1, x), y0 = std::min(y0, y), y1 = std::max(y1, y);
        }
      if (!in_event) {
        EXPECT_EQ(n_sat, 0) << r.video << " frame " << i << " (outside the event)";
        continue;
      }
      // A large shape: at least 5 % of the frame (the smallest, a triangle of side 0.44·size, is
      // 9.7 %).
      ASSERT_GE(n_sat, spec.size * spec.size / 20) << r.video << " frame " << i;
      EXPECT_EQ(colour_name(hue(sr, sg, sb)), r.answer) << r.video << " frame " << i;
      // The shape from how much of its bounding box it fills: 1 (square), π/4 (circle), 1/2.
      const double fill = n_sat / static_cast<double>((x1 - x0 + 1) * (y1 - y0 + 1));
      const std::string shape = fill > 0.9 ? "square" : fill > 0.68 ? "circle" : "triangle";
      EXPECT_EQ(shape, shape_of[r.video]) << r.video << " frame " << i << " fill " << fill;
      ++checked;
    }
  }
  EXPECT_EQ(checked, spec.videos * spec.event_seconds * spec.fps);
  std::cout << "event frames checked: " << checked
            << ", max saturation outside events: " << max_outside << "\n";
}

TEST(SyntheticTask, TheDemoSizedTaskTakesSeconds) {
  // The demo's default spec (200 videos of 3 minutes at 2 fps, 48 px): time it.
  SyntheticTaskSpec spec;
  const auto t0 = std::chrono::steady_clock::now();
  const SyntheticTask t = generate_synthetic_task((temp_dir() / "demo").string(), spec);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::cout << spec.videos << " videos of " << spec.seconds << " s: " << s << " s\n";
  EXPECT_EQ(t.train.size() + t.test.size(), 200u);
  // Generous: the point is seconds, not minutes, even on a loaded 2-core machine.
  EXPECT_LT(s, 60);
}

TEST(SyntheticTask, ErrorsNameTheField) {
  SyntheticTaskSpec spec = small_spec();
  spec.event_seconds = 40;
  try {
    generate_synthetic_task((temp_dir() / "bad").string(), spec);
    ADD_FAILURE() << "no error";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("event_seconds"), std::string::npos) << e.what();
  }
  const std::string path = (temp_dir() / "bad.jsonl").string();
  std::ofstream(path) << R"({"id": "a", "video": "/v.mp4", "question": "q", "answer": "red"})"
                      << "\n\n"
                      << R"({"id": "b", "video": "/v.mp4", "question": "q"})"
                      << "\n";
  try {
    read_task_jsonl(path);
    ADD_FAILURE() << "no error";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find(path + ":3: answer"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lvx::runtime
