// `lvx finetune` end to end on a tiny mPLUG-Owl3 (tests/reference/mplug_owl3_ref.py make-model:
// hidden 64, 4 layers, SigLIP 32 px / patch 8) and 4-second 64×64 test videos, at 2 real ranks:
//   - the loss falls on a learnable task, and the checkpoint loads with models::load_model;
//   - kill -9 of one rank mid-run, then --resume, reaches bitwise the same parameters and
//     optimizer state as the uninterrupted run (CPU, same rank count: the arithmetic repeats);
//   - a checkpoint write killed after its first file leaves the previous checkpoint as `latest`,
//     loadable, and --resume from it again matches bitwise;
//   - a corrupted checkpoint is named by --resume;
//   - bad input (dataset row, video, time range, config field, model dir) is one clear error and
//     nothing already written changes;
//   - AdamW + warm-up/cosine + clipping matches torch.optim.AdamW and clip_grad_norm_ (PyTorch
//     itself, the independent reference) within 1e-6 relative over 6 steps.
//   - config bounds and the changed fields --resume names; step folders without `latest` are
//     refused; manifests are XXH3 (old FNV-1a ones still verify); a non-finite gradient norm or
//     master weight is caught. (Divergence, trainer_state.json damage, metrics of other runs,
//     one rank's failure and a slow write end to end: tests/hostile/cases_finetune.py.)
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "models/model.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"
#include "src/runtime/optimizer.h"
#include "src/runtime/train_checkpoint.h"
#include "src/runtime/train_config.h"
#include "tests/model_conformance.h"

namespace {

using namespace lvx::testing;
namespace fs = std::filesystem;
using lvx::runtime::TrainConfig;

fs::path dir() {
  static const fs::path d = [] {
    const fs::path p = workdir() / "finetune";
    fs::create_directories(p);
    return p;
  }();
  return d;
}

// The tiny model, made once per generator version (build/tests/finetune_mplug).
const std::string& tiny_model() {
  static const std::string model = [] {
    const std::string script = std::string(LVX_SOURCE_DIR) + "/tests/reference/mplug_owl3_ref.py";
    std::string log;
    const std::string d = generated(
        "finetune_mplug", script_stamp(script),
        [&](const std::string& out) {
          return run_command(python() + " " + script + " make-model " + out +
                             "/model --variant 240728");
        },
        &log);
    EXPECT_FALSE(d.empty()) << log;
    return d + "/model";
  }();
  return model;
}

// Two short test videos and a dataset over them, made once per process.
const std::string& dataset() {
  static const std::string data = [] {
    const fs::path d = dir();
    for (const char* v : {"testsrc", "testsrc2"})
      EXPECT_EQ(run_command("ffmpeg -loglevel error -y -f lavfi -i " + std::string(v) +
                            "=size=64x64:rate=4 -t 4 -pix_fmt yuv420p " +
                            (d / (std::string(v) + ".mp4")).string()),
                "");
    const std::string path = (d / "train.jsonl").string();
    std::ofstream(path)
        << R"({"video": "testsrc.mp4", "question": "What pattern is shown?", "answer": "color bars"})"
        << "\n"
        << R"({"video": "testsrc2.mp4", "question": "What moves?", "answer": "shapes", "start": 1.0, "end": 3.5})"
        << "\n";
    return path;
  }();
  return data;
}

// A run config in `name`.yaml whose checkpoints go to `ck`.
std::string write_config(const std::string& name, const std::string& ck, int64_t steps,
                         const std::string& extra = "") {
  const std::string path = (dir() / (name + ".yaml")).string();
  std::ofstream(path) << "model: {path: " << tiny_model() << "}\n"
                      << "data: {train: " << dataset() << ", num_frames: 4, seed: 3}\n"
                      << "optimizer: {lr: 3.0e-3, weight_decay: 0.01, grad_clip: 1.0}\n"
                      << "schedule: {steps: " << steps << ", warmup_steps: 2, min_lr: 1.0e-4}\n"
                      << "checkpoint: {dir: " << ck << ", every: 2, keep: 3}\n"
                      << "parallel: {nproc: 2, strategies: \"lv_xattn,ring\"}\n"
                      << extra;
  return path;
}

std::string finetune(const std::string& config, const std::string& flags = "",
                     const std::string& env = "") {
  return run_command(env + " " + lvx_binary() + " finetune --config " + config + " " + flags);
}

std::string latest(const std::string& ck) { return lvx::runtime::latest_checkpoint(ck); }

// The largest difference between two checkpoints' tensors (model and optimizer state).
double max_diff(const std::string& a, const std::string& b) {
  double worst = 0;
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    auto ta = lvx::load_safetensors(a + "/" + f).tensors,
         tb = lvx::load_safetensors(b + "/" + f).tensors;
    EXPECT_EQ(ta.size(), tb.size()) << f;
    for (const auto& [name, t] : ta) {
      if (!tb.count(name)) return 1e30;
      worst = std::max(
          worst, (t.to(at::kDouble) - tb.at(name).to(at::kDouble)).abs().max().item<double>());
    }
  }
  return worst;
}

// The uninterrupted 6-step run, made once and shared by the resume tests.
const std::string& reference_run() {
  static const std::string ck = [] {
    const std::string c = (dir() / "ck_ref").string();
    fs::remove_all(c);
    const std::string log = finetune(write_config("ref", c, 6));
    EXPECT_EQ(log.find("exit status"), std::string::npos) << log;
    return c;
  }();
  return ck;
}

std::vector<nlohmann::json> metrics(const std::string& path) {
  std::vector<nlohmann::json> m;
  std::ifstream f(path);
  for (std::string line; std::getline(f, line);) m.push_back(nlohmann::json::parse(line));
  return m;
}

TEST(Finetune, LossFallsOnALearnableTask) {
  const std::string ck = (dir() / "ck_learn").string();
  fs::remove_all(ck);
  const std::string log = finetune(write_config("learn", ck, 10), "schedule.warmup_steps=1");
  ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
  const auto m = metrics(ck + "/metrics.jsonl");
  ASSERT_EQ(m.size(), 10u);
  const double first = (m[0]["loss"].get<double>() + m[1]["loss"].get<double>()) / 2;
  const double last = (m[8]["loss"].get<double>() + m[9]["loss"].get<double>()) / 2;
  std::cout << "loss: first two steps " << first << ", last two " << last << "\n";
  EXPECT_LT(last, 0.5 * first);
  for (const char* key : {"tokens_per_second", "eta_seconds", "lr", "grad_norm"})
    EXPECT_TRUE(m[0].contains(key)) << key;
  // The checkpoint is a model directory as `lvx qa` loads it.
  ASSERT_EQ(fs::path(latest(ck)).filename(), "step-000010");
  auto model = lvx::models::load_model(latest(ck), at::kFloat);
  EXPECT_EQ(model->family().model_type(), "mplugowl3");
}

TEST(Finetune, KillOfOneRankThenResumeEqualsTheUninterruptedRun) {
  const std::string ref = reference_run();
  const std::string ck = (dir() / "ck_kill").string();
  fs::remove_all(ck);
  const std::string config = write_config("kill", ck, 6);
  // Rank 1 is SIGKILLed as step 3 begins (after the step-2 checkpoint).
  const std::string log = finetune(config, "", "LVX_FAULT_KILL=1@3");
  EXPECT_NE(log.find("exit status"), std::string::npos) << log;
  EXPECT_EQ(fs::path(latest(ck)).filename(), "step-000002");
  const std::string resumed = finetune(config, "--resume");
  ASSERT_EQ(resumed.find("exit status"), std::string::npos) << resumed;
  EXPECT_NE(resumed.find("resumed from"), std::string::npos) << resumed;
  ASSERT_EQ(fs::path(latest(ck)).filename(), "step-000006");
  EXPECT_EQ(max_diff(latest(ck), latest(ref)), 0.0) << "not bitwise equal";
  // The resumed run's metrics continue the interrupted ones: one line per step.
  EXPECT_EQ(metrics(ck + "/metrics.jsonl").size(), 6u);
}

TEST(Finetune, InterruptedCheckpointWriteKeepsThePreviousOne) {
  const std::string ref = reference_run();
  const std::string ck = (dir() / "ck_fault").string();
  fs::remove_all(ck);
  const std::string config = write_config("fault", ck, 6);
  const std::string log = finetune(config, "", "LVX_FAULT_CHECKPOINT=after_first_file@4");
  EXPECT_NE(log.find("exit status"), std::string::npos) << log;
  EXPECT_TRUE(fs::exists(ck + "/step-000004.partial")) << log;
  ASSERT_EQ(fs::path(latest(ck)).filename(), "step-000002");
  lvx::runtime::verify_checkpoint(latest(ck));
  EXPECT_NO_THROW(lvx::models::load_model(latest(ck), at::kFloat));
  const std::string resumed = finetune(config, "--resume");
  ASSERT_EQ(resumed.find("exit status"), std::string::npos) << resumed;
  EXPECT_FALSE(fs::exists(ck + "/step-000004.partial"));
  EXPECT_EQ(max_diff(latest(ck), latest(ref)), 0.0) << "not bitwise equal";
}

TEST(Finetune, CorruptCheckpointIsNamed) {
  const std::string ref = reference_run();
  const std::string ck = (dir() / "ck_corrupt").string();
  fs::remove_all(ck);
  fs::copy(ref, ck, fs::copy_options::recursive);
  {
    std::fstream f(ck + "/step-000006/optimizer.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');
  }
  const std::string log = finetune(write_config("corrupt", ck, 8), "--resume");
  EXPECT_NE(log.find("exit status"), std::string::npos) << log;
  EXPECT_NE(log.find("corrupt checkpoint: optimizer.safetensors"), std::string::npos) << log;
  EXPECT_NE(log.find("step-000006"), std::string::npos) << log;
}

// Every bad input fails before anything is written: the existing checkpoints stay as they were.
TEST(Finetune, BadInputIsNamedAndNothingIsLost) {
  const std::string ref = reference_run();
  const std::string ck = (dir() / "ck_bad").string();
  fs::remove_all(ck);
  fs::copy(ref, ck, fs::copy_options::recursive);
  const std::string before = lvx::file_xxh3(ck + "/step-000006/model.safetensors");
  auto data = [&](const std::string& name, const std::string& row) {
    const std::string p = (dir() / (name + ".jsonl")).string();
    std::ofstream(p) << row << "\n";
    return "data.train=" + p;
  };
  const std::string v = (dir() / "testsrc.mp4").string();
  struct Case {
    std::string what, args, extra_yaml, expect;
  };
  const fs::path no_config = dir() / "model_without_config";
  fs::create_directories(no_config);
  const std::vector<Case> cases = {
      {"row missing a field", data("no_answer", R"({"video": ")" + v + R"(", "question": "q?"})"),
       "", "no_answer.jsonl:1: missing field 'answer'"},
      {"missing video",
       data("no_video", R"({"video": "nope.mp4", "question": "q?", "answer": "a"})"), "",
       "no_video.jsonl:1: field 'video':"},
      {"time range outside the video",
       data("late", R"({"video": ")" + v + R"(", "question": "q?", "answer": "a", "start": 10})"),
       "", "late.jsonl:1: field 'start' (10 s) is at or after the end"},
      {"unknown field", "", "logging: {evry: 3}\n", "logging.evry: unknown field"},
      {"wrongly typed field", "schedule.steps=many", "", "schedule.steps: expected an integer"},
      {"model dir without config.json", "model.path=" + no_config.string(), "",
       "has no config.json"},
      {"fresh run into a used checkpoint dir", "", "", "already holds checkpoints"},
  };
  for (const Case& c : cases) {
    const std::string log = finetune(write_config("bad", ck, 8, c.extra_yaml),
                                     (c.what.rfind("fresh", 0) == 0 ? "" : "--resume ") + c.args);
    EXPECT_NE(log.find("exit status"), std::string::npos) << c.what << ": " << log;
    EXPECT_NE(log.find(c.expect), std::string::npos) << c.what << ": " << log;
    EXPECT_EQ(fs::path(latest(ck)).filename(), "step-000006") << c.what;
    EXPECT_FALSE(fs::exists(ck + "/step-000008")) << c.what;
  }
  EXPECT_EQ(lvx::file_xxh3(ck + "/step-000006/model.safetensors"), before);
  lvx::runtime::verify_checkpoint(latest(ck));
}

TEST(FinetuneConfig, OverridesAndDefaults) {
  const std::string path = write_config("cfg", (dir() / "ck_cfg").string(), 5);
  const TrainConfig c = lvx::runtime::load_train_config(
      path, {"optimizer.lr=1e-3", "optimizer.betas=[0.8, 0.95]", "freeze.policy=cross_only"});
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.optimizer.betas[1], 0.95);
  EXPECT_EQ(c.freeze.policy, "cross_only");
  EXPECT_EQ(c.schedule.steps, 5);
  EXPECT_EQ(c.logging.metrics, (dir() / "ck_cfg").string() + "/metrics.jsonl");
  auto error_of = [&](const std::vector<std::string>& o) {
    try {
      lvx::runtime::load_train_config(path, o);
    } catch (const lvx::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of({"optimizer.lrr=1"}).find("optimizer.lrr: unknown field"), std::string::npos);
  EXPECT_NE(error_of({"freeze.policy=some"}).find("freeze.policy: expected one of vision"),
            std::string::npos);
  EXPECT_NE(error_of({"optimizer.betas=0.9"}).find("optimizer.betas: expected a list"),
            std::string::npos);
  EXPECT_NE(error_of({"train.lr=1"}).find("unknown section 'train'"), std::string::npos);
}

// Counts that size allocations are bounded; --resume's comparison names each changed field.
TEST(FinetuneConfig, BoundsAndChangedFields) {
  const std::string path = write_config("cfg_changes", (dir() / "ck_cfg").string(), 5);
  auto error_of = [&](const std::vector<std::string>& o) {
    try {
      lvx::runtime::load_train_config(path, o);
    } catch (const lvx::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of({"data.num_frames=100000"}).find("data.num_frames: at most 4096"),
            std::string::npos);
  EXPECT_NE(error_of({"parallel.nproc=5000"}).find("parallel.nproc: at most 1024"),
            std::string::npos);
  const TrainConfig a = lvx::runtime::load_train_config(path, {});
  // The recorded config reads back as it was: no changes.
  const TrainConfig back = lvx::runtime::train_config_from_yaml(lvx::runtime::to_yaml(a), "state");
  EXPECT_TRUE(lvx::runtime::config_changes(a, back).empty());
  const TrainConfig b = lvx::runtime::load_train_config(
      path, {"optimizer.lr=1e-3", "schedule.steps=9", "checkpoint.every=1", "logging.every=4"});
  const std::vector<std::string> changes = lvx::runtime::config_changes(a, b);
  ASSERT_EQ(changes.size(), 2u);  // checkpoint and logging may change on resume
  EXPECT_EQ(changes[0], "optimizer.lr: 0.003 -> 0.001");
  EXPECT_EQ(changes[1], "schedule.steps: 5 -> 9");
}

// Step folders without a `latest` pointer are refused (a fresh start would remove them, a resume
// would have to guess); leftovers of interrupted writes alone are not checkpoints.
TEST(FinetuneCheckpoint, StepFoldersWithoutLatestAreRefused) {
  const fs::path root = dir() / "ck_nolatest";
  fs::remove_all(root);
  fs::create_directories(root / "step-000004.partial");
  EXPECT_EQ(latest(root.string()), "");
  fs::create_directories(root / "step-000002");
  try {
    latest(root.string());
    ADD_FAILURE() << "no error";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds checkpoint folders (step-000002) but no 'latest'"),
              std::string::npos)
        << e.what();
  }
  std::ofstream(root / "latest") << "step-000002\n";
  EXPECT_EQ(fs::path(latest(root.string())).filename(), "step-000002");
}

// New manifests checksum with XXH3; a checkpoint written before (FNV-1a 64) still verifies.
TEST(FinetuneCheckpoint, ManifestIsXxh3AndOldFnvStillVerifies) {
  const std::string ref = latest(reference_run());
  const nlohmann::json m = nlohmann::json::parse(std::ifstream(ref + "/manifest.json"));
  for (const auto& [file, info] : m["files"].items()) {
    EXPECT_TRUE(info.contains("xxh3")) << file;
    EXPECT_FALSE(info.contains("fnv1a64")) << file;
  }
  const fs::path old = dir() / "ck_fnv" / "step-000001";
  fs::remove_all(old.parent_path());
  fs::create_directories(old);
  std::ofstream(old / "config.json") << "{}";
  std::ofstream(old / "manifest.json")
      << nlohmann::json{{"step", 1},
                        {"files",
                         {{"config.json",
                           {{"bytes", 2},
                            {"fnv1a64", lvx::file_fnv1a64((old / "config.json").string())}}}}}}
             .dump();
  EXPECT_NO_THROW(lvx::runtime::verify_checkpoint(old.string()));
  std::ofstream(old / "config.json") << "[]";
  EXPECT_THROW(lvx::runtime::verify_checkpoint(old.string()), lvx::Error);
}

// A non-finite gradient norm throws before anything changes; an update that makes a master
// non-finite (eps 0 where a gradient is 0) is named.
TEST(FinetuneOptimizer, NonFiniteValuesAreCaught) {
  TrainConfig::Optimizer o;
  TrainConfig::Schedule s;
  s.steps = 2;
  std::map<std::string, at::Tensor> params{{"a", at::ones({3})}, {"b", at::ones({2})}};
  lvx::runtime::AdamW opt(o, s);
  opt.init(params);
  std::map<std::string, at::Tensor> g{{"a", at::ones({3})}, {"b", at::ones({2})}};
  g["b"][0] = std::nan("");
  EXPECT_THROW(opt.step(g, params), lvx::runtime::NonFiniteGradient);
  EXPECT_EQ(opt.steps_done(), 0);
  EXPECT_TRUE(at::equal(params.at("a"), at::ones({3})));
  EXPECT_EQ(opt.non_finite_master(), "");
  o.eps = 0;
  lvx::runtime::AdamW zero_eps(o, s);
  zero_eps.init(params);
  std::map<std::string, at::Tensor> g2{{"a", at::ones({3})}, {"b", at::zeros({2})}};
  zero_eps.step(g2, params);
  EXPECT_EQ(zero_eps.non_finite_master(), "b");
}

// AdamW with fp32 masters, warm-up + cosine and clipping against PyTorch on the same gradients.
// Tolerance: 1e-6 of each parameter's scale (the arithmetic is the same operation by operation;
// measured 0).
TEST(FinetuneOptimizer, MatchesTorchAdamWAndClipGradNorm) {
  TrainConfig::Optimizer o;
  o.lr = 1e-2, o.betas = {0.9, 0.95}, o.eps = 1e-8, o.weight_decay = 0.1, o.grad_clip = 0.5;
  TrainConfig::Schedule s;
  s.steps = 6, s.warmup_steps = 2, s.min_lr = 1e-3;
  at::manual_seed(7);
  std::map<std::string, at::Tensor> params{
      {"a", at::randn({5, 7})}, {"b", at::randn({11})}, {"c", at::randn({3, 2, 2})}};
  std::map<std::string, at::Tensor> in;
  for (auto& [n, p] : params) in["param." + n] = p.clone();
  lvx::runtime::AdamW opt(o, s);
  opt.init(params);
  std::vector<double> norms, lrs;
  for (int64_t step = 0; step < s.steps; ++step) {
    std::map<std::string, at::Tensor> g;
    // Large gradients in some steps so that clipping acts, small in others so that it does not.
    const double scale = step % 2 ? 0.01 : 3.0;
    for (auto& [n, p] : params) {
      g[n] = at::randn(p.sizes()) * scale;
      in["grad." + std::to_string(step) + "." + n] = g[n].clone();
    }
    norms.push_back(opt.step(g, params));
    lrs.push_back(opt.last_lr());
  }
  const nlohmann::json cfg = {{"lr", o.lr},
                              {"betas", {o.betas[0], o.betas[1]}},
                              {"eps", o.eps},
                              {"weight_decay", o.weight_decay},
                              {"grad_clip", o.grad_clip},
                              {"steps", s.steps},
                              {"warmup_steps", s.warmup_steps},
                              {"min_lr", s.min_lr}};
  const std::string src = (dir() / "adamw_in.safetensors").string(),
                    dst = (dir() / "adamw_out.safetensors").string();
  lvx::save_safetensors(src, in, {{"config", cfg.dump()}});
  const std::string log = run_command(python() + " " + LVX_SOURCE_DIR +
                                      "/tests/reference/adamw_ref.py " + src + " " + dst);
  ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
  auto want = lvx::load_safetensors(dst).tensors;
  double worst = 0;
  for (auto& [n, p] : params) {
    const at::Tensor w = want.at("param." + n);
    worst = std::max(worst, (p - w).abs().max().item<double>() / w.abs().max().item<double>());
  }
  for (int64_t step = 0; step < s.steps; ++step) {
    const std::string k = std::to_string(step);
    EXPECT_NEAR(norms[step], want.at("norm." + k).item<double>(), 1e-6 * norms[step]) << step;
    EXPECT_NEAR(lrs[step], want.at("lr." + k).item<double>(), 1e-12) << step;
  }
  std::cout << "AdamW vs torch.optim.AdamW: max relative difference " << worst << "\n";
  EXPECT_LE(worst, 1e-6);
}

}  // namespace
