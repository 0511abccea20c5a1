// Fine-tuning benchmark: `lvx finetune` on a random mPLUG-Owl3 (240728) and synthetic test videos,
// samples per second with and without the memory savers — LV-XAttn's cross-layer K/V
// recomputation (parallel.recompute) and DistFlashAttn's rematerialization-aware checkpointing
// (parallel.remat) — run side by side in one invocation. Correctness first: every mode's loss at
// every step must equal the plain run's (both savers are exact; tolerance 1e-4 relative, fp32),
// then throughput is the median step time over the steps after the first (warm-up).
//   bench_finetune [--frames 32] [--nproc 2] [--hidden 128] [--layers 4] [--steps 4]
//
// --memory: sharded training state (parallel.shard) at world 1..4 on a larger random model
// (--hidden 1024 --layers 32: 0.30 B parameters, fp32): per stage and rank count, samples/s,
// the largest per-rank peak RSS above the process's own footprint before the model (metrics
// peak_rss_bytes − base_rss_bytes), lvx plan's prediction for the same run
// (planner::train_memory with the checkpoint's exact parameter counts, fp32) and their ratio, and
// the training-state bytes each rank sent per step against sharded_state.h's formula. Runs whose
// predicted memory for all ranks exceeds --host-gib are skipped (named).
//   bench_finetune --memory --hidden 1024 --layers 32 [--frames 8] [--steps 3]
//                  [--worlds 1,2,3,4] [--stages none,optimizer,gradients] [--host-gib 18]
//                  [--collectives auto,engine,p2p] [--model DIR]
// --model DIR: that checkpoint instead of a generated one (bench_real_size.py passes lvx
// init-model's mPLUG-Owl3-1B); --hidden and --layers are then ignored.
//
// --prefetch: the input pipeline (data.prefetch): the same run with samples prepared when taken
// (data.prefetch=0) and two ahead on a worker (data.prefetch=2), alternating --repeats times, on
// a video whose decode costs about what a step computes (--video-size, --video-seconds). Losses
// must be equal bit for bit first. Per run: the median step time, the input's own time per step
// (decode, sampling, preprocessing, prompt: metrics input_seconds) and the compute alone (step
// minus input, without prefetch); the goal is step ≤ 1.1 × max(input, compute) with prefetch.
//   bench_finetune --prefetch [--nproc 1] [--frames 32] [--video-size 640x360]
//                  [--video-seconds 60] [--repeats 3] [--steps 6]
// With several --collectives each run is made once per value of LVX_DIST_COLLECTIVES (auto: lvx's
// default; engine: the engines' own algorithms for every collective; p2p: lvx's rings of
// point-to-point messages), and auto's samples/s over each other's printed.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <utility>

#include "models/init.h"
#include "src/cli/args.h"
#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/planner/train_memory.h"
#include "src/runtime/model_description.h"

using namespace lvx;
namespace fs = std::filesystem;

namespace {

// A random checkpoint of the chosen width and depth (models/init.h: released names, a byte-level
// tokenizer with the chat template's special tokens, two hyper layers).
void make_model(const fs::path& dir, int64_t hidden, int64_t layers) {
  models::TinyModelSpec spec;
  spec.hidden = hidden;
  spec.layers = layers;
  spec.heads = hidden / 32;
  spec.kv_heads = std::max<int64_t>(1, hidden / 64);
  spec.intermediate = 2 * hidden;
  spec.hyper_layers = {1, layers / 2 + 1};  // 1-based, as in config.json
  spec.vision_hidden = 64;
  spec.vision_mlp = 128;
  models::write_tiny_mplug_owl3(dir.string(), spec);
}

std::string run(const std::string& cmd) {
  const std::string log = cmd + " > bench_finetune.log 2>&1";
  if (std::system(log.c_str()) != 0) {
    std::ifstream f("bench_finetune.log");
    LVX_FAIL("bench_finetune: ", cmd, " failed:\n",
             std::string(std::istreambuf_iterator<char>(f), {}));
  }
  return cmd;
}

struct Mode {
  const char* name;
  const char* overrides;
};
constexpr Mode kModes[] = {{"none", ""},
                           {"recompute", " parallel.recompute=true"},
                           {"remat", " parallel.remat=true"},
                           {"both", " parallel.recompute=true parallel.remat=true"}};

// The last metrics line of a run.
nlohmann::json last_metrics(const std::string& ck) {
  std::ifstream f(ck + "/metrics.jsonl");
  nlohmann::json last;
  for (std::string line; std::getline(f, line);) last = nlohmann::json::parse(line);
  LVX_CHECK(last.is_object(), "bench_finetune: ", ck, "/metrics.jsonl has no rows");
  return last;
}

// One row of --memory: the model, its parameter counts, and the run's settings.
struct MemoryCase {
  planner::ModelConfig m;
  planner::ParamCounts counts;
  std::string stage;  // a parallel.shard value, or "lora" / "lora-<shard>" (lora.r=16)
  int ranks = 1;
  int64_t frames = 0;
  bool lora() const { return stage.rfind("lora", 0) == 0; }
  std::string shard() const { return !lora() ? stage : stage == "lora" ? "none" : stage.substr(5); }
  planner::TrainMemoryOptions options() const {
    planner::TrainMemoryOptions o;
    o.shard = shard();
    o.lora_r = lora() ? 16 : 0;
    o.ranks = ranks;
    o.elem_bytes = 4;
    return o;
  }
  // sharded_state.h at one sample per step: none 2(n−1)/n·4Ψ (all-reduce); stages 1 and 2
  // (n−1)/n·4Ψ reduce-scatter + (n−1)/n·4Ψ parameter all-gather, the same volume; stage 3 the
  // reduce-scatter and every unit gathered for the forward, all but the root and the last layer
  // again for the backward (the measured adds uneven chunks and the norm's all-reduce).
  double formula_bytes() const {
    const double psi = lora() ? static_cast<double>(planner::lora_parameters(m, 16))
                              : static_cast<double>(counts.trainable);
    const double f = (ranks - 1.0) / ranks;
    if (lora() && shard() == "parameters")  // and the frozen layers, gathered twice but the last
      return f * 4 * 3 * psi +
             f * 4 *
                 (2 * static_cast<double>(counts.layers) - static_cast<double>(counts.max_layer));
    return shard() == "parameters"
               ? f * 4 * (3 * psi - static_cast<double>(counts.root + counts.max_block))
               : 2 * f * 4 * psi;
  }
};

// Runs one case with the collectives `impl` (LVX_DIST_COLLECTIVES: auto, lvx's default; engine,
// the engines' own for every collective; p2p, lvx's rings of messages as before the engines' own,
// src/dist/collectives_p2p.cpp), prints its row, returns its samples/s. `auto_sps` > 0: the same
// case's samples/s with auto, for the ratio.
double memory_row(const MemoryCase& c, const std::string& impl, double auto_sps,
                  const std::string& lvx) {
  LVX_CHECK(impl == "auto" || impl == "engine" || impl == "p2p",
            "--collectives: expected auto, engine and/or p2p, got '", impl, "'");
  const double gib = double(int64_t{1} << 30);
  const std::string ck = "ck_mem_" + c.stage + std::to_string(c.ranks);
  fs::remove_all(ck);
  run("LVX_DIST_COLLECTIVES=" + impl + " " + lvx + " finetune --config run.yaml checkpoint.dir=" +
      ck + " parallel.nproc=" + std::to_string(c.ranks) +
      (c.lora() ? std::string(" lora.r=16") : std::string()) + " parallel.shard=" + c.shard());
  const nlohmann::json j = last_metrics(ck);
  fs::remove_all(ck);
  const double measured =
      j.at("peak_rss_bytes").get<double>() - j.at("base_rss_bytes").get<double>();
  const planner::TrainMemory t =
      planner::train_memory(c.m, c.counts, c.frames, j.at("tokens").get<int64_t>(),
                            c.m.visual_tokens_per_frame, c.options(), 0);
  const double sps = j.at("samples_per_second").get<double>();
  const std::string vs = auto_sps > 0 ? std::to_string(auto_sps / sps).substr(0, 4) + "x" : "-";
  std::printf("| %s | %d | %s | %.3f | %s | %.2f | %.2f | %.3f | %.4g | %.4g |\n", c.stage.c_str(),
              c.ranks, impl.c_str(), sps, vs.c_str(), measured / gib, t.total / gib,
              measured / t.total, j.at("state_bytes_sent").get<double>(), c.formula_bytes());
  std::fflush(stdout);
  return sps;
}

int bench_memory(const cli::ArgParser& p, const fs::path& dir, const std::string& lvx) {
  const std::string model_dir = (dir / "model").string();
  MemoryCase c;
  c.m = runtime::planner_model(model_dir);
  c.counts = runtime::count_parameters(model_dir, c.m, "vision");
  c.frames = p.get_int("frames");
  const double gib = double(int64_t{1} << 30);
  std::printf(
      "mPLUG-Owl3 (random) %s: %.3f B parameters, %.3f B train (freeze vision), fp32; %s "
      "frames/sample, %s steps\n\n",
      p.get("model").empty()
          ? ("hidden " + p.get("hidden") + ", " + p.get("layers") + " layers").c_str()
          : p.get("model").c_str(),
      c.counts.total / 1e9, c.counts.trainable / 1e9, p.get("frames").c_str(),
      p.get("steps").c_str());
  std::printf(
      "| shard | ranks | collectives | samples/s | auto over this | peak RSS/rank GiB (measured) | "
      "predicted GiB | measured/predicted | state bytes/step/rank | formula |\n"
      "|---|---|---|---|---|---|---|---|---|---|\n");
  const double host = p.get_double("host-gib") * gib;
  for (const std::string& stage : p.get_list("stages"))
    for (const std::string& ws : p.get_list("worlds")) {
      c.stage = stage;
      c.ranks = std::stoi(ws);
      // Text tokens of the prompt are read back from the run; estimated to decide skipping.
      const double guess = planner::train_memory(c.m, c.counts, c.frames, c.frames + 64,
                                                 c.m.visual_tokens_per_frame, c.options(), 0)
                               .total;
      if (guess * c.ranks > host) {
        std::printf("| %s | %d | skipped: %.1f GiB predicted for %d ranks > --host-gib |||||||\n",
                    stage.c_str(), c.ranks, guess * c.ranks / gib, c.ranks);
        continue;
      }
      double auto_sps = 0;
      for (const std::string& impl : p.get_list("collectives")) {
        const double sps = memory_row(c, impl, impl == "auto" ? 0 : auto_sps, lvx);
        if (impl == "auto") auto_sps = sps;
      }
    }
  return 0;
}

// bench_finetune's options (defaults in --help).
void add_options(cli::ArgParser& p) {
  p.add_option("frames", 'f', "32", "frames per sample (16 visual tokens each)");
  p.add_option("nproc", 'n', "2", "ranks");
  p.add_option("hidden", 0, "128", "LM width (heads of 32)");
  p.add_option("layers", 0, "4", "LM layers (two are hyper layers)");
  p.add_option("steps", 0, "4", "optimizer steps per mode (the first is a warm-up)");
  p.add_option("model", 0, "", "an mPLUG-Owl3 checkpoint directory (default: a generated one)");
  p.add_flag("memory", 0, "sharded state: measured peak RSS per rank vs lvx plan's prediction");
  p.add_option("worlds", 0, "1,2,3,4", "--memory: rank counts");
  p.add_option("stages", 0, "none,optimizer,gradients,parameters",
               "--memory: parallel.shard values, and lora or lora-<shard> (lora.r=16)");
  p.add_option("host-gib", 0, "18", "--memory: skip runs predicted to need more host memory");
  p.add_flag("prefetch", 0, "the input pipeline: data.prefetch 0 against 2, side by side");
  p.add_option("video-size", 0, "64x64", "the training video's frame size");
  p.add_option("video-seconds", 0, "8", "the training video's length");
  p.add_option("repeats", 0, "3", "--prefetch: runs of each setting, alternating");
  p.add_option("collectives", 0, "auto",
               "--memory: auto (lvx's default), engine (the engines' own collectives for every\n"
               "op) and/or p2p (lvx's rings of messages): LVX_DIST_COLLECTIVES, side by side per\n"
               "stage and rank count");
}

// The training data and config in `dir` (the working folder): a synthetic test video, one QA
// row about it, and run.yaml with the options' frames, steps and ranks.
void write_run_inputs(const fs::path& dir, const cli::ArgParser& p) {
  run("ffmpeg -loglevel error -y -f lavfi -i testsrc=size=" + p.get("video-size") + ":rate=30 -t " +
      p.get("video-seconds") + " -pix_fmt yuv420p v.mp4");
  std::ofstream(dir / "train.jsonl")
      << R"({"video": "v.mp4", "question": "Describe the test pattern in detail.", "answer": "Colour bars with a moving counter and a gradient."})"
      << "\n";
  std::ofstream(dir / "run.yaml") << "model: {path: model}\n"
                                  << "data: {train: train.jsonl, num_frames: " << p.get("frames")
                                  << "}\n"
                                  << "optimizer: {lr: 1.0e-3}\n"
                                  << "schedule: {steps: " << p.get("steps") << "}\n"
                                  << "parallel: {nproc: " << p.get("nproc")
                                  << ", strategies: \"lv_xattn,ring\"}\n";
}

// One mode's run: its loss and step time at every step, and the median step time after the
// first (warm-up).
struct Result {
  std::string mode;
  std::vector<double> loss, secs;
  double median = 0;
};

// Fine-tunes with mode `m`'s overrides and reads its metrics back.
Result run_mode(const Mode& m, const std::string& lvx) {
  const std::string ck = std::string("ck_") + m.name;
  fs::remove_all(ck);
  run(lvx + " finetune --config run.yaml checkpoint.dir=" + ck + m.overrides);
  Result r{m.name, {}, {}, 0};
  std::ifstream f(ck + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    r.loss.push_back(j.at("loss"));
    r.secs.push_back(j.at("step_seconds"));
  }
  std::vector<double> timed(r.secs.begin() + (r.secs.size() > 1 ? 1 : 0), r.secs.end());
  std::sort(timed.begin(), timed.end());
  r.median = timed[timed.size() / 2];
  return r;
}

// Correctness: both savers are exact, so every step's loss equals the plain run's.
void check_losses_equal(const std::vector<Result>& results) {
  const Result& base = results.front();
  for (const Result& r : results)
    for (size_t s = 0; s < base.loss.size(); ++s)
      LVX_CHECK(std::abs(r.loss[s] - base.loss[s]) <= 1e-4 * std::abs(base.loss[s]),
                "bench_finetune: ", r.mode, " loss at step ", s + 1, " is ", r.loss[s],
                ", without recomputation ", base.loss[s]);
}

// The settings line and one table row per mode, speeds against the plain run's.
void print_results(const cli::ArgParser& p, const std::vector<Result>& results) {
  const Result& base = results.front();
  std::printf(
      "mPLUG-Owl3 hidden %s, %s layers, %s frames/sample, %s ranks, %s steps "
      "(losses equal across modes: step 1 %.6f, step %zu %.6f)\n\n",
      p.get("hidden").c_str(), p.get("layers").c_str(), p.get("frames").c_str(),
      p.get("nproc").c_str(), p.get("steps").c_str(), base.loss.front(), base.loss.size(),
      base.loss.back());
  std::printf("| saving | step s (median) | samples/s | vs none |\n|---|---|---|---|\n");
  for (const Result& r : results)
    std::printf("| %s | %.3f | %.2f | %.3fx |\n", r.mode.c_str(), r.median, 1.0 / r.median,
                base.median / r.median);
}

// --prefetch: one run's median step, input and compute seconds (after the first step), and its
// losses.
struct PipelineRun {
  std::vector<double> loss;
  double step = 0, input = 0, wait = 0;
};

double median_after_first(std::vector<double> v) {
  if (v.size() > 1) v.erase(v.begin());
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

PipelineRun pipeline_run(const std::string& lvx, int prefetch) {
  const std::string ck = "ck_prefetch" + std::to_string(prefetch);
  fs::remove_all(ck);
  run(lvx + " finetune --config run.yaml checkpoint.dir=" + ck +
      " data.prefetch=" + std::to_string(prefetch));
  std::vector<double> step, input, wait;
  PipelineRun r;
  std::ifstream f(ck + "/metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const auto j = nlohmann::json::parse(line);
    r.loss.push_back(j.at("loss"));
    step.push_back(j.at("step_seconds"));
    input.push_back(j.at("input_seconds"));
    wait.push_back(j.at("input_wait_seconds"));
  }
  fs::remove_all(ck);
  r.step = median_after_first(step);
  r.input = median_after_first(input);
  r.wait = median_after_first(wait);
  return r;
}

int bench_prefetch(const cli::ArgParser& p, const std::string& lvx) {
  std::vector<PipelineRun> off, on;
  for (int64_t i = 0; i < p.get_int("repeats"); ++i) {  // alternating: the machine's drift shared
    off.push_back(pipeline_run(lvx, 0));
    on.push_back(pipeline_run(lvx, 2));
    LVX_CHECK(on.back().loss == off.front().loss && off.back().loss == off.front().loss,
              "bench_finetune: the losses with and without prefetch differ");
  }
  auto med = [](const std::vector<PipelineRun>& rs, double PipelineRun::*f) {
    std::vector<double> v;
    for (const auto& r : rs) v.push_back(r.*f);
    std::sort(v.begin(), v.end());
    return std::make_pair(v[v.size() / 2], std::make_pair(v.front(), v.back()));
  };
  const auto step_off = med(off, &PipelineRun::step), step_on = med(on, &PipelineRun::step);
  const auto input = med(off, &PipelineRun::input), wait_on = med(on, &PipelineRun::wait);
  const double compute = step_off.first - input.first;
  const double bound = std::max(input.first, compute);
  std::printf(
      "mPLUG-Owl3 hidden %s, %s layers, %s frames/sample from a %s, %s s video, %s rank(s), "
      "%s steps, %s runs each (losses equal bit for bit)\n\n",
      p.get("hidden").c_str(), p.get("layers").c_str(), p.get("frames").c_str(),
      p.get("video-size").c_str(), p.get("video-seconds").c_str(), p.get("nproc").c_str(),
      p.get("steps").c_str(), p.get("repeats").c_str());
  std::printf("| measure | seconds per step, median (range) |\n|---|---|\n");
  auto row = [](const char* name, const std::pair<double, std::pair<double, double>>& m) {
    std::printf("| %s | %.3f (%.3f-%.3f) |\n", name, m.first, m.second.first, m.second.second);
  };
  row("step, data.prefetch=0", step_off);
  row("step, data.prefetch=2", step_on);
  row("input alone (decode, preprocessing, prompt)", input);
  std::printf("| compute alone (step - input, prefetch 0) | %.3f |\n", compute);
  row("step's wait for input, prefetch 2", wait_on);
  std::printf(
      "\nprefetch 2 over none: %.2fx faster; step / max(input, compute) = %.2f (goal <= 1.1)\n",
      step_off.first / step_on.first, step_on.first / bound);
  return 0;
}

int bench(int argc, char** argv) {
  cli::ArgParser p("bench_finetune [options]",
                   "Fine-tuning samples/s through `lvx finetune` with and without K/V\n"
                   "recomputation and rematerialization; losses compared first.");
  add_options(p);
  if (!p.parse(argc, argv)) return 0;
  const bool memory = p.flag("memory");
  const fs::path model = p.get("model").empty() ? fs::path() : fs::absolute(p.get("model"));
  const fs::path dir =
      fs::temp_directory_path() / ("lvx_bench_finetune_" + std::to_string(getpid()));
  fs::create_directories(dir);
  fs::current_path(dir);
  if (model.empty())
    make_model(dir / "model", p.get_int("hidden"), p.get_int("layers"));
  else
    fs::create_directory_symlink(model, dir / "model");
  write_run_inputs(dir, p);
  const std::string lvx =
      (fs::path(dist::self_executable()).parent_path().parent_path() / "lvx").string();
  if (memory || p.flag("prefetch")) {
    const int rc = memory ? bench_memory(p, dir, lvx) : bench_prefetch(p, lvx);
    fs::current_path(fs::temp_directory_path());
    fs::remove_all(dir);
    return rc;
  }
  std::vector<Result> results;
  for (const Mode& m : kModes) results.push_back(run_mode(m, lvx));
  check_losses_equal(results);
  print_results(p, results);
  fs::current_path(fs::temp_directory_path());
  fs::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return bench(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "bench_finetune: " << e.what() << "\n";
    return 1;
  }
}
