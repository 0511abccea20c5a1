// `lvx demo`: the main job on a small built-in default, end to end with real parts. No weights can
// be downloaded, so the demo makes its own long-video task and model:
//   1. a synthetic task written with lvx's FFmpeg bindings (tools/synthetic_task.h): videos
//      of a few minutes of grey distractors in which one coloured shape appears for a few seconds
//      at a random time; the question asks its colour;
//   2. a tiny random model of the demo's family (models/init.h: default_demo_family) with a
//      tokenizer holding the task's words;
//   3. `lvx finetune` on local ranks (sequence parallel: each rank decodes and encodes its own
//      frames, the visual tokens are never gathered);
//   4. `lvx qa` on the held-out videos, and again with the videos shuffled among the questions:
//      a baseline that cannot see the right video, so it sits near chance and the accuracy is the
//      video's doing; then one question under each attention strategy, with the bytes it moved.
// Everything lands in --workdir (default: demo/ beside the lvx binary); a re-run with the same
// settings reuses the task and the trained checkpoint and takes seconds.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <sstream>

#include "models/init.h"
#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/runtime/device.h"
#include "tools/synthetic_task.h"

namespace {

namespace fs = std::filesystem;
using namespace lvx;
using nlohmann::json;
using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t) {
  return std::chrono::duration<double>(clock_type::now() - t).count();
}

// Runs an lvx subcommand (this executable), its output passing through; throws on failure.
void run_lvx(const std::string& args, const std::string& quiet_log = "") {
  std::string cmd = "'" + dist::self_executable() + "' " + args;
  if (!quiet_log.empty()) cmd += " > '" + quiet_log + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  LVX_CHECK(rc == 0, "lvx demo: `lvx ", args, "` failed",
            quiet_log.empty() ? std::string() : "; its output is in " + quiet_log);
}

std::vector<json> read_rows(const std::string& path) {
  std::vector<json> rows;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) rows.push_back(json::parse(line));
  return rows;
}

struct Score {
  int64_t correct = 0, total = 0, failed = 0;
  double pct() const { return total ? 100.0 * static_cast<double>(correct) / total : 0; }
};

Score score(const std::vector<json>& rows) {
  Score s;
  for (const json& r : rows) {
    if (r.contains("error")) {
      ++s.failed;
      continue;
    }
    ++s.total;
    s.correct += r.value("correct", false) ? 1 : 0;
  }
  return s;
}

std::string human_bytes(double b) {
  std::ostringstream o;
  o << std::fixed << std::setprecision(1);
  if (b >= 1e6) {
    o << b / 1e6 << " MB";
  } else if (b >= 1e3) {
    o << b / 1e3 << " kB";
  } else {
    o << std::setprecision(0) << b << " B";
  }
  return o.str();
}

// --nproc auto: two ranks (the demo shows sequence parallelism), one where they would be on a
// one-GPU machine (--device auto or cuda), since ranks never share a GPU.
int64_t demo_ranks(const cli::ArgParser& p) {
  if (p.get("nproc") != "auto") return cli::checked_nproc(p);
  const std::string device = p.get("device");
  runtime::check_device_option(device);
  const int gpus = device == "cpu" ? 0 : runtime::cuda_device_count();
  if (gpus == 1) {
    std::cout << "lvx demo: one GPU: 1 rank on it (--nproc 2 --device cpu shows two ranks)\n";
    return 1;
  }
  return 2;
}

// The demo's settings, from its command line.
struct Demo {
  int64_t nproc = 0, frames = 0;
  std::string dir, stamp, steps, lr, threads, device_arg, qa_args;
  bool fresh = false, reuse = false;
  tools::SyntheticTaskSpec task;
  models::TinyModelSpec model;
  std::string stamp_path() const { return dir + "/stamp"; }
};

std::optional<Demo> parse_demo(int argc, char** argv) {
  cli::ArgParser p(
      "lvx demo [options]",
      "Long-video question answering end to end: makes a synthetic long-video task\n"
      "and a tiny random model, fine-tunes it with lvx finetune on local ranks, answers\n"
      "held-out videos with lvx qa, and prints the accuracy beside a baseline that\n"
      "sees the wrong videos, the per-layer plan and the bytes each strategy moved.");
  cli::add_nproc_options(p, "auto",
                         "local ranks (sequence parallel); auto: 2, or one per GPU where --device\n"
                         "puts the ranks on a machine with a single GPU (ranks never share one)");
  cli::add_threads_option(p);
  cli::add_device_option(p);
  p.add_option("videos", 0, "160", "videos in the task (a quarter held out)");
  p.add_option("seconds", 0, "180", "length of each video");
  p.add_option("frames", 'f', "24", "frames sampled per video");
  p.add_option("steps", 0, "1000", "fine-tuning steps");
  p.add_option("lr", 0, "1e-3", "peak learning rate");
  p.add_option("seed", 0, "0", "seed of the task and the model");
  p.add_option("workdir", 'w', "", "where everything goes (default: demo/ beside the lvx binary)");
  p.add_flag("fresh", 0, "start over (do not reuse an earlier task or checkpoint)");
  if (!p.parse(argc, argv)) return std::nullopt;
  Demo d;
  d.nproc = demo_ranks(p);
  d.frames = p.get_int("frames", 1, 100000);
  cli::apply_threads(p, static_cast<int>(d.nproc));
  runtime::check_local_devices(p.get("device"), static_cast<int>(d.nproc));  // before any work
  d.device_arg = " --device " + p.get("device");
  p.get_int("steps", 1, int64_t{1} << 40);  // both go into the run's YAML as written
  LVX_CHECK(p.get_double("lr") > 0, "--lr must be > 0, got ", p.get("lr"));
  d.steps = p.get("steps");
  d.lr = p.get("lr");
  d.threads = p.get("threads");
  d.dir = p.get("workdir").empty()
              ? (fs::path(dist::self_executable()).parent_path() / "demo").string()
              : fs::absolute(p.get("workdir")).string();
  d.fresh = p.flag("fresh");
  d.task.videos = p.get_int("videos");
  d.task.seconds = p.get_double("seconds");
  d.task.seed = p.get_int("seed");
  d.model.words = tools::synthetic_task_words();
  d.model.seed = static_cast<uint64_t>(p.get_int("seed"));
  // What the trained checkpoint depends on: a re-run with the same settings reuses it.
  d.stamp =
      str("demo v1 videos=", d.task.videos, " seconds=", d.task.seconds, " seed=", d.task.seed,
          " frames=", d.frames, " steps=", d.steps, " lr=", d.lr, " nproc=", d.nproc);
  d.qa_args = " --nproc " + std::to_string(d.nproc) +
              (p.flag("force-nproc") ? " --force-nproc" : "") + " --threads " + d.threads +
              " --num-frames " + std::to_string(d.frames) + " --max-new-tokens 4" + d.device_arg;
  return d;
}

// An earlier run with the same settings is reused; otherwise the workdir starts empty.
void prepare_workdir(Demo& d) {
  d.reuse = !d.fresh && fs::exists(d.stamp_path()) && [&] {
    std::ifstream f(d.stamp_path());
    std::string s((std::istreambuf_iterator<char>(f)), {});
    return s == d.stamp;
  }();
  if (!d.reuse) {
    fs::remove_all(d.dir);
    fs::create_directories(d.dir);
  }
  std::cout << "lvx demo: long-video question answering, end to end, on " << d.nproc
            << " local ranks (workdir " << d.dir << ")\n";
}

// 1. The task.
tools::SyntheticTask make_task(const Demo& d) {
  const auto t = clock_type::now();
  tools::SyntheticTask task;
  if (d.reuse) {
    task.dir = d.dir + "/task";
    task.train_jsonl = task.dir + "/train.jsonl";
    task.test_jsonl = task.dir + "/test.jsonl";
    task.train = tools::read_task_jsonl(task.train_jsonl);
    task.test = tools::read_task_jsonl(task.test_jsonl);
  } else {
    task = tools::generate_synthetic_task(d.dir + "/task", d.task);
  }
  std::printf(
      "[1/4] task: %zu videos of %.0f s at %d fps (%d px): grey distractors, one coloured shape "
      "for %.0f s at a random time; \"%s\" (%zu colours); %zu train / %zu held out  (%.1f s%s)\n",
      task.train.size() + task.test.size(), d.task.seconds, d.task.fps, d.task.size,
      d.task.event_seconds, tools::kColourQuestion, tools::synthetic_colours().size(),
      task.train.size(), task.test.size(), since(t), d.reuse ? ", reused" : "");
  return task;
}

// 2. The model.
std::string make_model(const Demo& d) {
  const auto t = clock_type::now();
  const std::string init = d.dir + "/init";
  const std::string family = models::default_demo_family();
  if (!d.reuse) models::write_tiny_model(family, init, d.model);
  std::printf("[2/4] model: %s  (%.1f s%s)\n", models::describe_tiny_model(family, d.model).c_str(),
              since(t), d.reuse ? ", reused" : "");
  return init;
}

// The run's YAML for lvx finetune.
void write_run_config(const Demo& d, const std::string& path, const std::string& init,
                      const tools::SyntheticTask& task, const std::string& run_dir) {
  std::ofstream(path) << "# Written by lvx demo: fine-tunes the tiny model on the task.\n"
                      << "model:\n  path: " << init << "\n  dtype: fp32\n"
                      << "data:\n  train: " << task.train_jsonl << "\n  num_frames: " << d.frames
                      << "\n  seed: " << d.task.seed << "\n"
                      << "optimizer:\n  lr: " << d.lr
                      << "\n  weight_decay: 0.01\n  grad_clip: 1.0\n"
                      << "schedule:\n  steps: " << d.steps
                      << "\n  warmup_steps: 30\n  min_lr: 1.0e-5\n"
                      << "freeze:\n  policy: vision\n"
                      << "checkpoint:\n  dir: " << run_dir << "\n  every: 250\n  keep: 2\n"
                      << "parallel:\n  nproc: " << d.nproc << "\n  strategies: auto\n"
                      << "logging:\n  metrics: " << run_dir << "/metrics.jsonl\n  every: 100\n";
}

// The loss curve, mean over windows of 200 steps (metrics.jsonl: one row per step).
void print_loss_curve(const std::string& metrics) {
  const std::vector<json> m = read_rows(metrics);
  std::string curve;
  double sum = 0, tps = 0;
  int n = 0;
  for (size_t i = 0; i < m.size(); ++i) {
    sum += m[i]["loss"].get<double>();
    tps += m[i].value("tokens_per_second", 0.0);
    ++n;
    if ((i + 1) % 200 == 0 || i + 1 == m.size()) {
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%s%.3g", curve.empty() ? "" : " -> ", sum / n);
      curve += buf;
      sum = 0;
      n = 0;
    }
  }
  if (!m.empty())
    std::printf("      loss per 200 steps: %s; %.0f text tokens/s\n", curve.c_str(),
                tps / static_cast<double>(m.size()));
}

// 3. Fine-tuning; returns the trained checkpoint.
std::string fine_tune(const Demo& d, const tools::SyntheticTask& task, const std::string& init) {
  const auto t = clock_type::now();
  const std::string run_dir = d.dir + "/run";
  const std::string config = d.dir + "/run.yaml";
  // The last checkpoint lvx finetune wrote (its `latest` names it).
  auto latest = [&] {
    std::ifstream f(run_dir + "/latest");
    std::string name;
    std::getline(f, name);
    return name.empty() ? std::string() : run_dir + "/" + name;
  };
  if (!d.reuse || latest().empty()) {
    write_run_config(d, config, init, task, run_dir);
    std::printf("[3/4] fine-tune: lvx finetune --config %s (log: %s/finetune.log)\n",
                config.c_str(), run_dir.c_str());
    std::fflush(stdout);
    fs::create_directories(run_dir);
    run_lvx("finetune --config '" + config + "'" + d.device_arg, run_dir + "/finetune.log");
  }
  print_loss_curve(run_dir + "/metrics.jsonl");
  const std::string trained = latest();
  LVX_CHECK(!trained.empty(), "lvx demo: lvx finetune wrote no checkpoint in ", run_dir);
  std::printf("[3/4] fine-tuned checkpoint %s  (%.1f s%s)\n", trained.c_str(), since(t),
              d.reuse ? ", reused" : "");
  return trained;
}

// The held-out questions, each with another question's video (a random permutation, rotated by
// one): it shows the asked-for colour only by chance, 1 in 6 with balanced colours.
void write_shuffled(const std::string& test_jsonl, const std::string& path, int64_t seed) {
  const std::vector<json> rows = read_rows(test_jsonl);
  std::vector<std::string> videos;
  for (const json& r : rows) videos.push_back(r["video"]);
  std::mt19937_64 rng(static_cast<uint64_t>(seed) + 17);
  std::vector<size_t> order(rows.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), rng);
  std::ofstream out(path);
  for (size_t i = 0; i < rows.size(); ++i) {
    json r = rows[order[i]];
    r["video"] = videos[order[(i + 1) % rows.size()]];
    out << r.dump() << "\n";
  }
}

// 4. Held-out questions, then the same questions with the videos shuffled among them: the
// accuracy beside the baseline. Returns the held-out rows.
std::vector<json> answer_held_out(const Demo& d, const tools::SyntheticTask& task,
                                  const std::string& trained) {
  const auto t = clock_type::now();
  const std::string answers = d.dir + "/answers.jsonl", shuffled_q = d.dir + "/shuffled.jsonl",
                    shuffled_a = d.dir + "/answers_shuffled.jsonl";
  write_shuffled(task.test_jsonl, shuffled_q, d.task.seed);
  fs::remove(answers);
  fs::remove(shuffled_a);
  const std::string qa_args = " --model '" + trained + "'" + d.qa_args;
  run_lvx("qa --questions '" + task.test_jsonl + "' --output '" + answers + "'" + qa_args,
          d.dir + "/qa.log");
  run_lvx("qa --questions '" + shuffled_q + "' --output '" + shuffled_a + "'" + qa_args,
          d.dir + "/qa_shuffled.log");
  const std::vector<json> rows = read_rows(answers);
  const Score acc = score(rows), base = score(read_rows(shuffled_a));
  std::printf("[4/4] answered %lld held-out questions twice with lvx qa  (%.1f s)\n\n",
              static_cast<long long>(acc.total + base.total) / 2, since(t));
  const double chance = 100.0 / static_cast<double>(tools::synthetic_colours().size());
  std::printf("accuracy on held-out videos:           %5.1f%%  (%lld/%lld)\n", acc.pct(),
              static_cast<long long>(acc.correct), static_cast<long long>(acc.total));
  std::printf("baseline, videos shuffled (wrong one): %5.1f%%  (%lld/%lld; chance %.1f%%)\n",
              base.pct(), static_cast<long long>(base.correct), static_cast<long long>(base.total),
              chance);
  if (acc.failed + base.failed > 0)
    std::printf("failed questions: %lld (see %s)\n",
                static_cast<long long>(acc.failed + base.failed), answers.c_str());
  std::printf("goal (>= 90%% held out, baseline near chance): %s\n",
              acc.pct() >= 90 && base.pct() < 2 * chance ? "met" : "NOT met");
  return rows;
}

// Examples: the first right answer, and the first wrong one if there is one; returns the first
// (with its plan and timings printed), or none.
const json* print_examples(const std::vector<json>& rows) {
  const json* example = nullptr;
  for (const bool want : {true, false})
    for (const json& r : rows) {
      if (!r.contains("response") || r.value("correct", false) != want) continue;
      std::printf("\n%s: %s\n  video %s, %lld frames on %lld ranks -> \"%s\" (truth: %s)\n",
                  want ? "example" : "a wrong answer", r["question"].get<std::string>().c_str(),
                  r["video"].get<std::string>().c_str(),
                  static_cast<long long>(r["frames"].get<int64_t>()),
                  static_cast<long long>(r["ranks"].get<int64_t>()),
                  r["response"].get<std::string>().c_str(), r["answer"].get<std::string>().c_str());
      if (!example) {
        example = &r;
        std::printf("  plan: %s\n", r["plan"].get<std::string>().c_str());
        std::printf(
            "  time to first token %.3f s (video decode %.3f s, prefill %.3f s), %.1f ms per "
            "token\n",
            r["timings"]["ttft_s"].get<double>(), r["timings"]["video_decode_s"].get<double>(),
            r["timings"]["prefill_s"].get<double>(),
            1e3 * r["timings"]["decode_per_token_s"].get<double>());
      }
      break;
    }
  return example;
}

// One question under each prefill strategy: the same answer, different bytes.
void compare_strategies(const Demo& d, const json& example, const std::string& trained) {
  std::printf(
      "\nbytes moved by all ranks for that question, by strategy (prefill; decoding is "
      "pass-Q whatever the prefill ran):\n");
  std::printf("  %-22s %-10s %12s %16s\n", "cross,self", "answer", "prefill", "decode/token");
  for (const char* s : {"lv_xattn,ring", "lv_xattn,striped", "ring,ring", "all_gather,all_gather",
                        "ulysses,ulysses"}) {
    const std::string out = d.dir + "/one_" + std::string(s) + ".json";
    run_lvx("qa --video '" + example["video"].get<std::string>() + "' --question '" +
                example["question"].get<std::string>() + "' --json --strategies " + s +
                " --model '" + trained + "'" + d.qa_args + " > '" + out + "' 2>/dev/null",
            "");
    std::ifstream in(out);
    const json r = json::parse(in);
    std::printf("  %-22s %-10s %12s %16s\n", s, r["response"].get<std::string>().c_str(),
                human_bytes(r["bytes"]["prefill"].get<double>()).c_str(),
                human_bytes(r["bytes"]["decode_per_token"].get<double>()).c_str());
  }
}

int cmd_demo(int argc, char** argv) {
  std::optional<Demo> d = parse_demo(argc, argv);
  if (!d) return 0;
  const auto t_start = clock_type::now();
  prepare_workdir(*d);
  const tools::SyntheticTask task = make_task(*d);
  const std::string init = make_model(*d);
  const std::string trained = fine_tune(*d, task, init);
  const std::vector<json> rows = answer_held_out(*d, task, trained);
  const json* example = print_examples(rows);
  if (example && d->nproc > 1) compare_strategies(*d, *example, trained);
  std::ofstream(d->stamp_path()) << d->stamp;
  std::printf("\nlvx demo: done in %.1f s; answers in %s\n", since(t_start),
              (d->dir + "/answers.jsonl").c_str());
  return 0;
}

}  // namespace

LVX_COMMAND("demo",
            "the main job: fine-tune a tiny model on a synthetic long-video task, answer held-out "
            "videos",
            cmd_demo);
