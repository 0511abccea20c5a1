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
//     itself, the independent reference) within 1e-6 relative over 6 steps;
//   - every parallel.shard stage, LoRA under each, data × sequence parallel, global metrics, the
//     global batch across a resume, and TensorBoard's loader on the event files.
//   - config bounds and the changed fields --resume names; step folders without `latest` are
//     refused; manifests are XXH3 (old FNV-1a ones still verify); a non-finite gradient norm or
//     master weight is caught. (Divergence, trainer_state.json damage, metrics of other runs,
//     one rank's failure and a slow write end to end: tests/hostile/cases_finetune.py.)
// Over 600 lines, not split: every case here leans on the same file-local helpers (the tiny model
// and videos, the config writer, the run-and-read-back of a checkpoint that the resume and shard
// cases compare bitwise), and one binary per area keeps CI's link count low; a split by concern
// (shard stages, data parallel, metrics) would first move those helpers into a shared test header.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>

#include "models/model.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"
#include "src/dist/process_group.h"
#include "src/runtime/optimizer.h"
#include "src/runtime/sharded_state.h"
#include "src/runtime/tensorboard.h"
#include "src/runtime/train_checkpoint.h"
#include "src/runtime/train_config.h"
#include "tests/build_paths.h"
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

// The tiny model, made once per generator version (generated(): the test-reference cache).
const std::string& tiny_model() {
  static const std::string model = [] {
    const std::string script = lvx::testing::source_dir() + "/tests/reference/mplug_owl3_ref.py";
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

// A fault (LVX_FAULT_* in `env`) needs lvx-faults: lvx with the test seam's hooks installed
// (src/runtime/train_faults.h, tests/support/fault_injection.cpp).
std::string finetune(const std::string& config, const std::string& flags = "",
                     const std::string& env = "") {
  const std::string bin =
      env.find("LVX_FAULT_") == std::string::npos ? lvx_binary() : lvx_faults_binary();
  return run_command(env + " " + bin + " finetune --config " + config + " " + flags);
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

// Samples prepared ahead of the step (data.prefetch, the default 2 in the reference run) give the
// same bits as each prepared when taken (0), and as three ahead on two workers; the metrics say
// how long the step waited for its input.
TEST(Finetune, PrefetchGivesTheSameBitsAsNone) {
  const std::string ref = reference_run();
  for (const char* flags : {"data.prefetch=0", "data.prefetch=3 data.workers=2"}) {
    const std::string ck = (dir() / "ck_prefetch").string();
    fs::remove_all(ck);
    const std::string log = finetune(write_config("prefetch", ck, 6), flags);
    ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
    EXPECT_EQ(max_diff(latest(ck), latest(ref)), 0.0) << flags << ": not bitwise equal";
    const auto m = metrics(ck + "/metrics.jsonl");
    ASSERT_EQ(m.size(), 6u);
    for (const auto& line : m) {
      EXPECT_GT(line["input_seconds"].get<double>(), 0) << flags;
      // Without prefetch the step waits for all of its input (the wait is timed around it).
      if (std::string(flags) == "data.prefetch=0") {
        EXPECT_GE(line["input_wait_seconds"].get<double>(), line["input_seconds"].get<double>());
      }
      EXPECT_GT(line["model_flops"].get<double>(), 0) << flags;
      EXPECT_TRUE(line["mfu"].is_null()) << "no parallel.cluster: no peak";
    }
  }
}

// MFU is the step's model FLOPs per second over the cluster config's GEMM peak in the run's dtype
// times the ranks (an H100 config: 50 TFLOP/s fp32 each, 2 ranks); the same FLOPs every step
// (one fixed sample shape). Beside it the planner's predicted step: the FLOPs at that peak plus
// the step's collectives, here one all-reduce of the Ψt fp32 gradients over 2 ranks of a node
// (a ring: 2·(n−1)/n·4Ψt bytes at the intra-node 350 GB/s, and 2·(n−1) latencies of 8 µs).
TEST(Finetune, MfuIsTheRateOverTheClustersPeak) {
  const std::string ck = (dir() / "ck_mfu").string();
  fs::remove_all(ck);
  const std::string log =
      finetune(write_config("mfu", ck, 2), "parallel.cluster=" + lvx::testing::source_dir() +
                                               "/configs/clusters/h100_80g_16.yaml");
  ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
  EXPECT_NE(log.find("MFU against 100 TFLOP/s"), std::string::npos) << log;
  const auto m = metrics(ck + "/metrics.jsonl");
  ASSERT_EQ(m.size(), 2u);
  for (const auto& line : m) {
    const double rate = line["model_flops"].get<double>() / line["step_seconds"].get<double>();
    EXPECT_NEAR(line["flops_per_second"].get<double>(), rate, 1e-9 * rate);
    EXPECT_NEAR(line["mfu"].get<double>(), rate / 100e12, 1e-9 * rate / 100e12);
  }
  std::smatch trainable;
  ASSERT_TRUE(std::regex_search(log, trainable, std::regex(R"(: (\d+) of \d+ parameters train)")))
      << log;
  const double traffic = 2.0 * 0.5 * 4.0 * std::stod(trainable[1]) / 350e9 + 2 * 8e-6;
  for (const auto& line : m) {
    EXPECT_NEAR(line["predicted_traffic_seconds"].get<double>(), traffic, 1e-9 * traffic);
    const double want = line["model_flops"].get<double>() / 100e12 + traffic;
    EXPECT_NEAR(line["predicted_step_seconds"].get<double>(), want, 1e-9 * want);
  }
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
  // A section as a flow-style map sets each of its fields.
  const TrainConfig l = lvx::runtime::load_train_config(path, {"lora={r: 8, alpha: 16}"});
  EXPECT_EQ(l.lora.r, 8);
  EXPECT_DOUBLE_EQ(l.lora.alpha, 16);
  EXPECT_NE(error_of({"lora=8"}).find("a section takes a map"), std::string::npos);
  // Numbers print as people write them, and read back as they were.
  const std::string y = lvx::runtime::to_yaml(lvx::runtime::load_train_config(
      path, {"optimizer.betas=[0.9, 0.95]", "schedule.min_lr=1e-5"}));
  EXPECT_NE(y.find("betas: [0.9, 0.95]"), std::string::npos) << y;
  EXPECT_NE(y.find("min_lr: 1e-05"), std::string::npos) << y;
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
  // 2^62 samples per step hung a run in its first step.
  EXPECT_NE(error_of({"optimizer.grad_accum=4611686018427387904"})
                .find("optimizer.grad_accum: must be at most 1048576"),
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
  // Printed as written: 30, not %g's 3e+01.
  const std::vector<std::string> w = lvx::runtime::config_changes(
      a, lvx::runtime::load_train_config(path,
                                         {"schedule.warmup_steps=30", "optimizer.grad_clip=30"}));
  ASSERT_FALSE(w.empty());
  EXPECT_NE(w[0].find("-> 30"), std::string::npos) << w[0];
}

// qa, serve, forward, plan and merge-adapter take a run folder for its latest checkpoint; a
// checkpoint or adapter folder is itself.
TEST(FinetuneCheckpoint, RunFolderMeansItsLatestCheckpoint) {
  const fs::path root = dir() / "ck_follow";
  fs::remove_all(root);
  fs::create_directories(root / "step-000003");
  std::ofstream(root / "step-000003" / "config.json") << "{}";
  std::ofstream(root / "latest") << "step-000003\n";
  EXPECT_EQ(lvx::runtime::follow_run_folder(root.string()), (root / "step-000003").string());
  EXPECT_EQ(lvx::runtime::follow_run_folder((root / "step-000003").string()),
            (root / "step-000003").string());
  EXPECT_EQ(lvx::runtime::follow_run_folder("configs/models/tiny.yaml"),
            "configs/models/tiny.yaml");
  std::ofstream(root / "latest") << "step-000009\n";
  try {
    lvx::runtime::follow_run_folder(root.string());
    ADD_FAILURE() << "no error for a latest naming a missing folder";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("names step-000009, which does not exist"),
              std::string::npos)
        << e.what();
  }
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
  const std::string log = run_command(python() + " " + lvx::testing::source_dir() +
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

// ---- sharded training state and data × sequence parallel (src/runtime/sharded_state.h) --------
//
// Tolerance: the stages compute AdamW's update elementwise exactly as `none` does; only gradient
// sums (across ranks and samples) and the global norm round differently (fp32). Adam turns those
// ~1e-7 relative differences into at most lr · (relative change) per step for parameters with a
// real gradient, but for parameters whose exact gradient is zero (the key biases: softmax is
// invariant to them) it normalises pure rounding noise, moving them by up to lr · noise / eps per
// step. optimizer.eps = 1e-6 (above that noise) and 2e-5 absolute over 3 steps of lr <= 3e-3
// covers both (measured: <= 6e-6; a wrong shard or a missing rank's gradient moves parameters by
// ~lr = 1e-3 per step).
namespace {

constexpr double kShardTol = 2e-5;

struct TrainState {
  std::map<std::string, at::Tensor> weights;
  std::map<std::string, at::Tensor> optimizer;  // flat master, exp_avg, exp_avg_sq
};

TrainState train_state(const std::string& ckpt) {
  TrainState s;
  // A LoRA run's checkpoint holds the adapter instead of the weights.
  const bool lora = !fs::exists(ckpt + "/model.safetensors");
  s.weights =
      lvx::load_safetensors(ckpt + (lora ? "/adapter_model.safetensors" : "/model.safetensors"))
          .tensors;
  const nlohmann::json st =
      nlohmann::json::parse(lvx::read_file(ckpt + "/trainer_state.json", "t"));
  const auto layout =
      lvx::runtime::FlatLayout::from_json(st["optimizer"]["layout"], ckpt + "/trainer_state.json");
  s.optimizer = lvx::runtime::load_flat_optimizer_state(ckpt, layout, 0, layout.numel());
  return s;
}

double state_diff(const std::string& a, const std::string& b) {
  const TrainState x = train_state(a), y = train_state(b);
  double worst = 0;
  EXPECT_EQ(x.weights.size(), y.weights.size());
  for (const auto& [name, t] : x.weights)
    worst = std::max(
        worst, (t.to(at::kDouble) - y.weights.at(name).to(at::kDouble)).abs().max().item<double>());
  for (const auto& [name, t] : x.optimizer)
    worst = std::max(
        worst,
        (t.to(at::kDouble) - y.optimizer.at(name).to(at::kDouble)).abs().max().item<double>());
  return worst;
}

// A 3-step run (grad_accum 2, eps 1e-6) at `ranks` with extra overrides; returns its directory.
std::string shard_run(const std::string& name, int ranks, const std::string& flags,
                      const std::string& env = "") {
  const std::string ck = (dir() / ("ck_" + name)).string();
  fs::remove_all(ck);
  const std::string log = finetune(
      write_config(name, ck, 3),
      lvx::str("optimizer.eps=1e-6 optimizer.grad_accum=2 parallel.nproc=", ranks, " ", flags),
      env);
  EXPECT_EQ(log.find("exit status"), std::string::npos) << log;
  return ck;
}

// Trainable elements of a run (its recorded layout) and rank 0's shard-range chunk sizes.
int64_t trainable_numel(const std::string& ckpt) {
  const nlohmann::json st =
      nlohmann::json::parse(lvx::read_file(latest(ckpt) + "/trainer_state.json", "t"));
  return lvx::runtime::FlatLayout::from_json(st["optimizer"]["layout"], "t").numel();
}

// Stage 3's bytes per sample for rank 0 of `w` (fp32 parameters): the model's units are its
// decoder layers (names with ".layers.<l>.") and the rest (the root, gathered once per sample);
// each layer's runs of consecutive elements in the flat layout are all-gathered for the forward
// and, but for the last layer's, again for the backward (ring: rank 0 sends every rank's piece
// of a run but rank 1's), and reduce-scattered once (rank 0 sends every piece but its own).
// Rank 0's fp32 bytes for all-gathering a vector whose ranks hold `pieces` elements on Gloo's
// default, lvx's ring of messages (process_group.h): every piece but rank 1's.
int64_t gather_bytes0(const std::vector<int64_t>& pieces) {
  int64_t b = 0;
  for (size_t j = 0; j < pieces.size(); ++j) b += j == 1 ? 0 : 4 * pieces[j];
  return pieces.size() > 1 ? b : 0;
}

// The runs of each unit (decoder layer, or -1: the rest) of a run's flat trainable layout, and
// each rank's piece of a run.
struct Runs {
  std::map<int64_t, std::vector<std::pair<int64_t, int64_t>>> by_unit;
  int64_t psi = 0;
  std::vector<int64_t> pieces(int64_t b, int64_t e, int w) const {
    std::vector<int64_t> p;
    for (int q = 0; q < w; ++q) {
      const auto [sb, se] = lvx::dist::shard_range(psi, w, q);
      p.push_back(std::max<int64_t>(0, std::min(e, se) - std::max(b, sb)));
    }
    return p;
  }
};

Runs layout_runs(const std::string& ckpt) {
  const nlohmann::json st =
      nlohmann::json::parse(lvx::read_file(latest(ckpt) + "/trainer_state.json", "t"));
  const auto layout = lvx::runtime::FlatLayout::from_json(st["optimizer"]["layout"], "t");
  Runs r;
  r.psi = layout.numel();
  const std::regex layer_re(R"(\.layers\.(\d+)\.)");
  for (size_t i = 0; i < layout.names.size(); ++i) {
    std::smatch m;
    const int64_t unit = std::regex_search(layout.names[i], m, layer_re) ? std::stoll(m[1]) : -1;
    auto& v = r.by_unit[unit];
    if (!v.empty() && v.back().second == layout.offsets[i])
      v.back().second = layout.offsets[i + 1];
    else
      v.push_back({layout.offsets[i], layout.offsets[i + 1]});
  }
  return r;
}

// Stage 3, rank 0, per sample: every run of every unit gathered for the forward and, but for the
// last layer's (kept), again for the backward, and reduce-scattered (every piece but rank 0's).
int64_t stage3_bytes_per_sample(const std::string& ckpt, int w) {
  if (w == 1) return 0;
  const Runs runs = layout_runs(ckpt);
  const int64_t last = runs.by_unit.rbegin()->first;
  int64_t bytes = 0;
  for (const auto& [unit, rs] : runs.by_unit)
    for (const auto& [b, e] : rs) {
      const auto p = runs.pieces(b, e, w);
      bytes += gather_bytes0(p) * (unit == last || unit < 0 ? 1 : 2) + 4 * (e - b - p[0]);
    }
  return bytes;
}

// Stage 2 after the update: the new values gathered run by run (refresh_parameters).
int64_t stage2_gather_bytes(const std::string& ckpt, int w) {
  if (w == 1) return 0;
  const Runs runs = layout_runs(ckpt);
  int64_t bytes = 0;
  for (const auto& [unit, rs] : runs.by_unit)
    for (const auto& [b, e] : rs) bytes += gather_bytes0(runs.pieces(b, e, w));
  return bytes;
}

// Stage 3 with LoRA also gathers each decoder layer's frozen weights (fp32 here), split evenly
// (shard_range over the layer's frozen elements): rank 0's bytes per sample, every layer twice
// (forward, backward) but the last (kept).
int64_t frozen_bytes_per_sample(int w) {
  if (w == 1) return 0;
  const auto model = lvx::models::load_model(tiny_model(), at::kFloat, at::Device(at::kMeta));
  std::map<int64_t, int64_t> frozen;  // layer -> elements
  for (const auto& [name, t] : model->parameters())
    if (const int64_t l = model->decoder_layer_of(name); l >= 0) frozen[l] += t.numel();
  const int64_t last = frozen.rbegin()->first;
  int64_t bytes = 0;
  for (const auto& [l, f] : frozen) {
    std::vector<int64_t> pieces;
    for (int q = 0; q < w; ++q) {
      const auto [b, e] = lvx::dist::shard_range(f, w, q);
      pieces.push_back(e - b);
    }
    bytes += gather_bytes0(pieces) * (l == last ? 1 : 2);
  }
  return bytes;
}

}  // namespace

TEST(FinetuneShard, EveryStageEqualsNoneAtWorlds1To4WithFormulaBytes) {
  for (int w = 1; w <= 4; ++w) {
    const std::string none = shard_run(lvx::str("none", w), w, "");
    const int64_t psi = trainable_numel(none);
    auto chunk = [&](int q) {
      const auto [b, e] = lvx::dist::shard_range(psi, w, q % w);
      return e - b;
    };
    // Rank 0's bytes per step (fp32 gradients and parameters, A = 2 samples per step): none
    // all-reduces each sample (every chunk but chunk 1, then every chunk but chunk 2); the
    // stages reduce-scatter (all chunks but rank 0's own) once per step (optimizer) or per sample
    // (gradients), then all-gather the parameters (Gloo's default, lvx's ring: every chunk but
    // chunk 1): at once (optimizer), or run by run (gradients), plus the norm's all-reduce of one
    // double (at most 16 bytes).
    const int64_t rs = 4 * (psi - chunk(0)), ag = 4 * (psi - chunk(1));
    const int64_t ar = w == 1 ? 0 : 4 * (2 * psi - chunk(1) - chunk(2));
    const std::map<std::string, int64_t> want = {
        {"none", 2 * ar},
        {"optimizer", w == 1 ? 0 : rs + ag},
        {"gradients", w == 1 ? 0 : 2 * rs + stage2_gather_bytes(none, w)},
        {"parameters", 2 * stage3_bytes_per_sample(none, w)}};
    for (const std::string stage : {"none", "optimizer", "gradients", "parameters"}) {
      // Stages 2 and 3 reduce layer by layer: most layers lie in one rank's shard, some cross
      // a shard boundary, the rest (embeddings, head, projector) in two runs.
      const std::string ck =
          stage == "none" ? none : shard_run(lvx::str(stage, w), w, "parallel.shard=" + stage);
      const double d = stage == "none" ? 0 : state_diff(latest(none), latest(ck));
      std::cout << "world " << w << " shard " << stage << ": max |diff| vs none " << d << "\n";
      EXPECT_LE(d, kShardTol) << "world " << w << " " << stage;
      for (const auto& m : metrics(ck + "/metrics.jsonl")) {
        const int64_t got = m["state_bytes_sent"].get<int64_t>();
        EXPECT_GE(got, want.at(stage)) << "world " << w << " " << stage;
        EXPECT_LE(got, want.at(stage) + 16) << "world " << w << " " << stage;
      }
    }
    if (w >= 2) {
      // The optimizer state is sharded beside the consolidated weights.
      const std::string g = latest((dir() / lvx::str("ck_gradients", w)).string());
      for (int q = 0; q < w; ++q)
        EXPECT_TRUE(fs::exists(g + "/" + lvx::runtime::optimizer_shard_name(q, w))) << g;
      EXPECT_FALSE(fs::exists(g + "/optimizer.safetensors"));
      EXPECT_NO_THROW(lvx::models::load_model(g, at::kFloat));
    }
  }
}

TEST(FinetuneShard, ResumeAtAnotherWorldSizeReshards) {
  // Uninterrupted: gradients at 2 ranks, 3 steps (checkpoints at 2 and 3).
  const std::string full = shard_run("rs_full", 2, "parallel.shard=gradients");
  for (const auto& [ranks, stage] : std::vector<std::pair<int, std::string>>{
           {3, "gradients"}, {1, "none"}, {4, "optimizer"}, {3, "parameters"}}) {
    const std::string ck = (dir() / lvx::str("ck_rs_", ranks, stage)).string();
    fs::remove_all(ck);
    fs::create_directories(ck);
    fs::copy(full + "/step-000002", ck + "/step-000002", fs::copy_options::recursive);
    std::ofstream(ck + "/latest") << "step-000002\n";
    fs::copy(full + "/metrics.jsonl", ck + "/metrics.jsonl");
    const std::string log = finetune(
        write_config(lvx::str("rs_", ranks, stage), ck, 3),
        lvx::str("--resume optimizer.eps=1e-6 optimizer.grad_accum=2 parallel.nproc=", ranks,
                 " parallel.shard=", stage));
    ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
    EXPECT_NE(log.find("resumed from"), std::string::npos) << log;
    ASSERT_EQ(fs::path(latest(ck)).filename(), "step-000003");
    // Step 3 ran at another rank count (other attention arithmetic): fp32 rounding apart.
    const double d = state_diff(latest(full), latest(ck));
    std::cout << "resume 2 ranks (gradients) -> " << ranks << " (" << stage << "): max |diff| " << d
              << "\n";
    EXPECT_LE(d, kShardTol);
  }
  // Kill -9 of one rank after the step-2 checkpoint, then --resume at the same rank count and
  // stage: bitwise the uninterrupted run (the same arithmetic repeats). Stages 2 and 3.
  const std::string full3 = shard_run("rs_full3", 2, "parallel.shard=parameters");
  for (const auto& [stage, uninterrupted] : std::vector<std::pair<std::string, std::string>>{
           {"gradients", full}, {"parameters", full3}}) {
    const std::string ck = (dir() / ("ck_rs_kill_" + stage)).string();
    fs::remove_all(ck);
    const std::string config = write_config("rs_kill_" + stage, ck, 3);
    const std::string flags =
        "optimizer.eps=1e-6 optimizer.grad_accum=2 parallel.nproc=2 parallel.shard=" + stage;
    const std::string killed = finetune(config, flags, "LVX_FAULT_KILL=1@2");
    EXPECT_NE(killed.find("exit status"), std::string::npos) << killed;
    ASSERT_EQ(fs::path(latest(ck)).filename(), "step-000002");
    const std::string resumed = finetune(config, "--resume " + flags);
    ASSERT_EQ(resumed.find("exit status"), std::string::npos) << resumed;
    EXPECT_EQ(state_diff(latest(uninterrupted), latest(ck)), 0.0) << stage << ": not bitwise equal";
  }
}

// LoRA under every parallel.shard stage: the adapter's state sharded like any trainable state,
// and at stage 3 the frozen base model too (each decoder layer's weights 1/n per rank, gathered
// while the layer runs and its backward passes). Same adapter and optimizer state as LoRA without
// sharding (fp32 rounding of the sums apart), and kill -9 + --resume at stage 3 is bitwise.
TEST(FinetuneShard, LoraUnderEveryStageEqualsUnshardedAndResumes) {
  const std::string lora = "lora.r=4 lora.alpha=8 ";
  for (int w : {2, 3}) {
    const std::string none = shard_run(lvx::str("lora_none", w), w, lora);
    ASSERT_TRUE(fs::exists(latest(none) + "/adapter_model.safetensors"));
    for (const std::string stage : {"optimizer", "gradients", "parameters"}) {
      const std::string ck =
          shard_run(lvx::str("lora_", stage, w), w, lora + "parallel.shard=" + stage);
      const double d = state_diff(latest(none), latest(ck));
      std::cout << "LoRA world " << w << " shard " << stage << ": max |diff| vs none " << d << "\n";
      EXPECT_LE(d, kShardTol) << "world " << w << " " << stage;
      if (stage == "parameters") {  // the adapter's units and the frozen base, 2 samples a step
        const int64_t want = 2 * (stage3_bytes_per_sample(ck, w) + frozen_bytes_per_sample(w));
        for (const auto& m : metrics(ck + "/metrics.jsonl")) {
          EXPECT_GE(m["state_bytes_sent"].get<int64_t>(), want) << "world " << w;
          EXPECT_LE(m["state_bytes_sent"].get<int64_t>(), want + 16) << "world " << w;
        }
      }
      for (int q = 0; q < w; ++q)
        EXPECT_TRUE(fs::exists(latest(ck) + "/" + lvx::runtime::optimizer_shard_name(q, w)));
    }
  }
  const std::string full = shard_run("lora_full3", 2, lora + "parallel.shard=parameters");
  const std::string ck = (dir() / "ck_lora_kill").string();
  fs::remove_all(ck);
  const std::string config = write_config("lora_kill", ck, 3);
  const std::string flags = lora +
                            "optimizer.eps=1e-6 optimizer.grad_accum=2 parallel.nproc=2 "
                            "parallel.shard=parameters";
  EXPECT_NE(finetune(config, flags, "LVX_FAULT_KILL=1@2").find("exit status"), std::string::npos);
  ASSERT_EQ(fs::path(latest(ck)).filename(), "step-000002");
  const std::string resumed = finetune(config, "--resume " + flags);
  ASSERT_EQ(resumed.find("exit status"), std::string::npos) << resumed;
  EXPECT_EQ(state_diff(latest(full), latest(ck)), 0.0) << "LoRA stage 3: not bitwise equal";
}

// logging.tensorboard: TensorBoard's own loader reads every step's metrics from lvx's event files
// (the loss, as written to metrics.jsonl, to float precision); CRC-32C against its check value.
TEST(FinetuneMetrics, TensorBoardReadsTheRunsScalars) {
  EXPECT_EQ(lvx::runtime::crc32c("123456789", 9), 0xE3069283u);  // the CRC-32C check value
  const std::string tb = (dir() / "tb_events").string();
  fs::remove_all(tb);
  const std::string ck = shard_run("tb", 1, "logging.tensorboard=" + tb);
  const std::string out = run_command(python() + " " + lvx::testing::source_dir() +
                                      "/tests/reference/tensorboard_ref.py read " + tb);
  const nlohmann::json j = nlohmann::json::parse(out.substr(out.find('{')));
  const auto m = metrics(ck + "/metrics.jsonl");
  ASSERT_EQ(m.size(), 3u);
  ASSERT_TRUE(j.contains("train/loss")) << out;
  ASSERT_EQ(j["train/loss"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(j["train/loss"][i][0].get<int64_t>(), static_cast<int64_t>(i + 1));
    EXPECT_NEAR(j["train/loss"][i][1].get<double>(), m[i]["loss"].get<double>(),
                1e-6 * std::abs(m[i]["loss"].get<double>()));
  }
  for (const char* tag : {"train/lr", "train/grad_norm", "train/tokens_per_second",
                          "train/samples_per_second", "train/peak_rss_bytes"})
    EXPECT_TRUE(j.contains(tag)) << tag;
}

namespace {

// World 2 as 2 data-parallel groups × 1 rank against world 1 with grad_accum 4: the same state,
// and the metrics are the whole run's: the two groups' tokens and frames of a step are the one
// group's tokens and frames of the same 4 samples, and the groups are said.
void expect_two_groups_equal_grad_accum(const std::string& one, const std::string& dp2) {
  const double d1 = state_diff(latest(one), latest(dp2));
  std::cout << "2x1 vs world 1 grad_accum 4: " << d1 << "\n";
  EXPECT_LE(d1, kShardTol);
  const auto m1 = metrics(one + "/metrics.jsonl"), m2 = metrics(dp2 + "/metrics.jsonl");
  ASSERT_EQ(m1.size(), m2.size());
  for (size_t i = 0; i < m1.size(); ++i) {
    EXPECT_EQ(m2[i]["tokens"], m1[i]["tokens"]) << "step " << i + 1;
    EXPECT_EQ(m2[i]["frames"], m1[i]["frames"]) << "step " << i + 1;
    EXPECT_EQ(m2[i]["data_parallel_groups"].get<int64_t>(), 2);
    EXPECT_EQ(m2[i]["ranks"].get<int64_t>(), 2);
    EXPECT_DOUBLE_EQ(m2[i]["samples_per_second_per_rank"].get<double>(),
                     m2[i]["samples_per_second"].get<double>() / 2);
  }
}

// Resuming the 2-group run at 1 rank keeps its global batch of 4 samples (grad_accum 2 -> 4,
// said), so it continues as the world-1 run with grad_accum 4 would; 3 groups cannot keep it
// and are refused by name.
void expect_resume_at_one_rank_keeps_global_batch(const std::string& one, const std::string& dp2) {
  const std::string ck = (dir() / "ck_dp_resume").string();
  fs::remove_all(ck);
  fs::create_directories(ck);
  fs::copy(dp2 + "/step-000002", ck + "/step-000002", fs::copy_options::recursive);
  std::ofstream(ck + "/latest") << "step-000002\n";
  fs::copy(dp2 + "/metrics.jsonl", ck + "/metrics.jsonl");
  const std::string config = write_config("dp_resume", ck, 3);
  const std::string three =
      finetune(config,
               "--resume optimizer.eps=1e-6 optimizer.grad_accum=2 parallel.nproc=3 "
               "parallel.sp_size=1");
  EXPECT_NE(three.find("the run's global batch is 4 samples per step"), std::string::npos) << three;
  EXPECT_EQ(fs::path(latest(ck)).filename(), "step-000002");
  const std::string log =
      finetune(config, "--resume optimizer.eps=1e-6 optimizer.grad_accum=2 parallel.nproc=1");
  ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
  EXPECT_NE(log.find("optimizer.grad_accum 2 -> 4 keeps the global batch of 4"), std::string::npos)
      << log;
  const double d = state_diff(latest(one), latest(ck));
  std::cout << "2 groups resumed at 1 rank vs world 1 grad_accum 4: " << d << "\n";
  EXPECT_LE(d, kShardTol);
}

// World 4 as 2 × 2 (the run `dp4`, then with sharded gradients and parameters too) against world
// 2 (one sequence-parallel group) with grad_accum 4.
void expect_2x2_equals_world_2(const std::string& two, const std::string& dp4) {
  const std::string dp4g = shard_run("dp_2x2g", 4, "parallel.sp_size=2 parallel.shard=gradients");
  const std::string dp4p = shard_run("dp_2x2p", 4, "parallel.sp_size=2 parallel.shard=parameters");
  for (const std::string& ck : {dp4, dp4g, dp4p}) {
    const double d = state_diff(latest(two), latest(ck));
    std::cout << fs::path(ck).filename().string() << " vs world 2 grad_accum 4: " << d << "\n";
    EXPECT_LE(d, kShardTol);
  }
}

// The same under a launcher that says the 4 ranks are 2 nodes of 2 (lvx launch --nodes 2, as
// torchrun on two machines): each sequence-parallel group is one node; stage 3 over all 4.
void expect_2_nodes_equal_world_2(const std::string& two) {
  const std::string ckn = (dir() / "ck_dp_nodes").string();
  fs::remove_all(ckn);
  const std::string log =
      run_command(lvx_binary() + " launch --nproc 4 --nodes 2 -- " + lvx_binary() +
                  " finetune --config " + write_config("dp_nodes", ckn, 3) +
                  " optimizer.eps=1e-6 optimizer.grad_accum=2 parallel.nproc=4 parallel.sp_size=2 "
                  "parallel.shard=parameters");
  ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
  const double d = state_diff(latest(two), latest(ckn));
  std::cout << "2 nodes x 2 ranks (stage 3) vs world 2 grad_accum 4: " << d << "\n";
  EXPECT_LE(d, kShardTol);
}

// sp_size must divide the world, and parallel.shard takes only its stages' names.
void expect_bad_parallel_settings_refused() {
  const std::string ck = (dir() / "ck_dp_bad").string();
  fs::remove_all(ck);
  const std::string log =
      finetune(write_config("dp_bad", ck, 3), "parallel.nproc=3 parallel.sp_size=2");
  EXPECT_NE(log.find("parallel.sp_size: 2 does not divide the 3 ranks"), std::string::npos) << log;
  const std::string typo = finetune(write_config("dp_bad", ck, 3), "parallel.shard=zero2");
  EXPECT_NE(typo.find("parallel.shard"), std::string::npos) << typo;
  EXPECT_FALSE(fs::exists(ck + "/latest"));
}

}  // namespace

TEST(FinetuneDataParallel, GroupsTakeTheSamplesGradAccumWouldTake) {
  // World 2 as 2 data-parallel groups × 1 rank == world 1 with grad_accum 2 × 2 = 4.
  const std::string one = shard_run("dp_one", 1, "optimizer.grad_accum=4");
  const std::string dp2 = shard_run("dp_2x1", 2, "parallel.sp_size=1");
  expect_two_groups_equal_grad_accum(one, dp2);
  if (HasFatalFailure()) return;  // a failed ASSERT in a step ends the test, as in one body
  expect_resume_at_one_rank_keeps_global_batch(one, dp2);
  if (HasFatalFailure()) return;
  // World 4 as 2 × 2 == world 2 (one sequence-parallel group) with grad_accum 4; with sharded
  // gradients too.
  const std::string two = shard_run("dp_two", 2, "optimizer.grad_accum=4");
  const std::string dp4 = shard_run("dp_2x2", 4, "parallel.sp_size=2");
  expect_2x2_equals_world_2(two, dp4);
  expect_2_nodes_equal_world_2(two);
  if (HasFatalFailure()) return;
  // The recorded data position counts every group's samples: 3 steps × 2 × 2 groups.
  const nlohmann::json st =
      nlohmann::json::parse(lvx::read_file(latest(dp4) + "/trainer_state.json", "t"));
  EXPECT_EQ(st["data"]["samples_seen"].get<int64_t>(), 12);
  expect_bad_parallel_settings_refused();
}

// ---- evaluation during training (src/runtime/finetune_eval.h) --------------------------------

namespace {

// Held-out rows in the dataset's folder (the videos resolve next to it).
std::string eval_rows(const std::string& name, const std::vector<std::string>& rows) {
  const std::string path = (fs::path(dataset()).parent_path() / (name + ".jsonl")).string();
  std::ofstream f(path);
  for (const auto& r : rows) f << r << "\n";
  return path;
}

const std::string kRow0 =
    R"({"video": "testsrc.mp4", "question": "What pattern is shown?", "answer": "color bars"})";
const std::string kRow1 =
    R"({"video": "testsrc2.mp4", "question": "What moves?", "answer": "shapes", "start": 1.0, "end": 3.5})";

}  // namespace

// The held-out loss is the training loss without its backward: with the data in file order at
// one group, step 3 trains on row 0 with the parameters step 2 left, so the evaluation after
// step 2 on row 0 alone must give step 3's logged loss. The answers are lvx qa's: the last
// evaluation's rows equal `lvx qa` on the last checkpoint, response for response. The best
// checkpoint by eval_loss is the one best.json names, with the value of its metrics line, and it
// outlives checkpoint.keep.
TEST(FinetuneEval, LossIsTheTrainingLossAndAnswersAreLvxQas) {
  const std::string rows = eval_rows("eval_row0", {kRow0});
  const std::string ck = (dir() / "ck_eval").string();
  fs::remove_all(ck);
  const std::string log = finetune(write_config("eval", ck, 4,
                                                "eval: {data: " + rows +
                                                    ", every: 2, max_new_tokens: 6, best_metric: "
                                                    "eval_loss}\n"),
                                   "data.shuffle=false checkpoint.keep=1 checkpoint.every=0");
  ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
  EXPECT_NE(log.find("eval after step 2: loss"), std::string::npos) << log;
  std::map<int64_t, nlohmann::json> train, eval;
  for (const auto& m : metrics(ck + "/metrics.jsonl"))
    (m.contains("eval_loss") ? eval : train)[m["step"].get<int64_t>()] = m;
  ASSERT_EQ(train.size(), 4u);
  ASSERT_EQ(eval.size(), 2u);
  ASSERT_TRUE(eval.count(2) && eval.count(4));
  const double held_out = eval[2]["eval_loss"].get<double>(),
               trained = train[3]["loss"].get<double>();
  std::cout << "eval after step 2 on row 0: " << held_out << "; step 3's training loss: " << trained
            << "\n";
  EXPECT_NEAR(held_out, trained, 1e-6 * std::abs(trained));
  EXPECT_EQ(eval[4]["eval_rows"].get<int64_t>(), 1);
  EXPECT_EQ(eval[4]["eval_scored"].get<int64_t>(), 1);
  // lvx qa on the step-4 checkpoint, at the run's ranks, frames and strategies.
  const std::string out = (dir() / "eval_qa.jsonl").string();
  fs::remove(out);
  fs::remove(out + ".settings.json");
  const std::string qa =
      run_command(lvx_binary() + " qa --model " + ck + "/step-000004" + " --questions " + rows +
                  " --output " + out + " --num-frames 4 --max-new-tokens 6 --nproc 2 --dtype fp32" +
                  " --strategies lv_xattn,ring");
  ASSERT_EQ(qa.find("exit status"), std::string::npos) << qa;
  const auto mine = metrics(ck + "/eval/step-000004.jsonl"), theirs = metrics(out);
  ASSERT_EQ(mine.size(), 1u);
  ASSERT_EQ(theirs.size(), 1u);
  EXPECT_EQ(mine[0]["response"], theirs[0]["response"]);
  EXPECT_EQ(mine[0]["correct"], theirs[0]["correct"]);
  EXPECT_EQ(eval[4]["eval_correct"].get<int64_t>(), theirs[0]["correct"].get<bool>() ? 1 : 0);
  // Evaluations checkpoint (every: 0 would keep only the last); best.json names the lower loss.
  const auto best = lvx::runtime::read_best_checkpoint(ck);
  ASSERT_TRUE(best.has_value());
  const int64_t best_step =
      eval[2]["eval_loss"].get<double>() < eval[4]["eval_loss"].get<double>() ? 2 : 4;
  EXPECT_EQ(best->step, best_step);
  EXPECT_EQ(best->metric, "eval_loss");
  EXPECT_DOUBLE_EQ(best->value, eval[best_step]["eval_loss"].get<double>());
  EXPECT_TRUE(fs::is_directory(ck + "/" + best->checkpoint));
  EXPECT_TRUE(fs::is_directory(ck + "/step-000004"));  // latest
}

// Stage 3 gathers each layer for the held-out forward as it does for training, and two
// data-parallel groups split 3 rows (one group runs an uncounted forward so the gathers match):
// the loss equals one rank's, unsharded, within the stages' tolerance on the parameters.
TEST(FinetuneEval, ShardedDataParallelLossEqualsOneRanks) {
  const std::string rows = eval_rows("eval_rows3", {kRow0, kRow1, kRow1});
  const std::string flags = "'eval={data: " + rows + ", every: 1, accuracy: false}'";
  const std::string one = shard_run("eval_one", 1, flags);
  const std::string dp =
      shard_run("eval_dp", 2, flags + " parallel.sp_size=1 parallel.shard=parameters");
  std::map<int64_t, double> a, b;
  for (const auto& m : metrics(one + "/metrics.jsonl"))
    if (m.contains("eval_loss")) a[m["step"].get<int64_t>()] = m["eval_loss"].get<double>();
  for (const auto& m : metrics(dp + "/metrics.jsonl"))
    if (m.contains("eval_loss")) {
      b[m["step"].get<int64_t>()] = m["eval_loss"].get<double>();
      EXPECT_EQ(m["eval_rows"].get<int64_t>(), 3);
    }
  ASSERT_EQ(a.size(), 3u);
  ASSERT_EQ(b.size(), 3u);
  for (const auto& [step, loss] : a) {
    std::cout << "step " << step << ": eval_loss " << loss << " (1 rank) vs " << b[step]
              << " (2 groups, stage 3)\n";
    EXPECT_NEAR(b[step], loss, 1e-4 * std::abs(loss)) << "step " << step;
  }
  // Accuracy needs whole layers for every new token: refused at stage 3, by name.
  const std::string log = finetune(write_config("eval_bad", (dir() / "ck_eval_bad").string(), 3),
                                   "'eval={data: " + rows + "}' parallel.shard=parameters");
  EXPECT_NE(log.find("eval.accuracy"), std::string::npos) << log;
  const std::string log2 = finetune(write_config("eval_bad", (dir() / "ck_eval_bad").string(), 3),
                                    "'eval={data: " + rows +
                                        ", accuracy: false, best_metric: "
                                        "eval_accuracy}'");
  EXPECT_NE(log2.find("eval.best_metric: eval_accuracy needs eval.accuracy"), std::string::npos)
      << log2;
}

// checkpoint.keep removes old checkpoints but never the one best.json names.
TEST(FinetuneCheckpoint, TheBestCheckpointOutlivesKeep) {
  const std::string root = (dir() / "ck_best_keep").string();
  fs::remove_all(root);
  const std::map<std::string, std::string> files{{"config.json", "{}"}};
  const std::map<std::string, at::Tensor> params{{"w", at::ones({2})}};
  auto save = [&](int64_t step) {
    lvx::runtime::save_train_checkpoint(root, step, files, params, {}, {{"step", step}},
                                        /*keep=*/1);
  };
  save(1);
  lvx::runtime::write_best_checkpoint(root, {"step-000001", 1, "eval_loss", 0.5});
  save(2);
  save(3);
  EXPECT_TRUE(fs::is_directory(root + "/step-000001"));
  EXPECT_FALSE(fs::exists(root + "/step-000002"));
  EXPECT_TRUE(fs::is_directory(root + "/step-000003"));
  const auto best = lvx::runtime::read_best_checkpoint(root);
  ASSERT_TRUE(best.has_value());
  EXPECT_EQ(best->checkpoint, "step-000001");
  EXPECT_DOUBLE_EQ(best->value, 0.5);
}
