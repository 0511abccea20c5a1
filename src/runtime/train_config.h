// The run description of `lvx finetune`: a YAML file (configs/runs/finetune_tiny.yaml) with the
// sections below, and dotted overrides from the command line ("optimizer.lr=1e-3"). Every field
// is typed and checked; a field the loader does not know is an error naming its path, so a typo
// never silently falls back to a default. docs/finetune.md lists every field and its default.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lvx::runtime {

struct TrainConfig {
  struct Model {
    std::string path;            // checkpoint directory (config.json, weights, tokenizer.json)
    std::string dtype = "fp32";  // fp32 | bf16 (compute dtype; master weights are always fp32)
  } model;
  struct Data {
    std::string train;                  // JSONL of video questions with answers (video_qa.h)
    std::optional<int64_t> num_frames;  // exactly one of num_frames and fps
    std::optional<double> fps;
    bool shuffle = true;  // a seeded permutation per epoch (seed + epoch)
    int64_t seed = 0;
    // Samples prepared ahead of the step (decoded, preprocessed, prompted) on `workers` threads:
    // the results are the same bits as without (src/runtime/sample_prefetch.h). 0: none.
    int64_t prefetch = 2;
    int64_t workers = 1;
  } data;
  struct Optimizer {
    double lr = 1e-4;
    std::array<double, 2> betas{0.9, 0.999};
    double eps = 1e-8;
    double weight_decay = 0.0;
    double grad_clip = 1.0;  // max global L2 norm; 0 = no clipping
    int64_t grad_accum = 1;  // samples per optimizer step (gradients averaged)
  } optimizer;
  struct Schedule {
    int64_t steps = 0;         // optimizer steps in the whole run
    int64_t warmup_steps = 0;  // linear warm-up from lr/warmup_steps to lr
    double min_lr = 0.0;       // cosine decay from lr to min_lr over the remaining steps
  } schedule;
  struct Freeze {
    std::string policy = "vision";  // vision | cross_only | none
  } freeze;
  struct Checkpoint {
    std::string dir;    // holds step-NNNNNN/ checkpoints and the `latest` pointer
    int64_t every = 0;  // steps between checkpoints (0: only at the end); the last step always
    int64_t keep = 2;   // newest checkpoints kept (older ones are removed after a new one)
  } checkpoint;
  struct ParallelCfg {
    int64_t nproc = 1;
    std::string strategies = "auto";  // auto | S | S_cross,S_self
    std::string cluster;              // cluster config for auto (empty: the built-in rule)
    bool recompute = false;           // LV-XAttn K/V recomputation (models/recompute.h)
    bool remat = false;               // DistFlashAttn rematerialization-aware checkpointing
    // Sharded training state (src/runtime/sharded_state.h): none | optimizer | gradients |
    // parameters, ZeRO stages 0–3.
    std::string shard = "none";
    // Ranks per sequence-parallel group (0: every rank); world = DP × sp_size, DP groups take
    // different samples.
    int64_t sp_size = 0;
  } parallel;
  // LoRA (models/lora.h): with r > 0 only the adapter trains (freeze.policy does not apply) and
  // checkpoints hold the adapter in PEFT's layout instead of the weights (docs/finetune.md).
  struct Lora {
    int64_t r = 0;       // rank; 0 (no `lora:` section): full fine-tuning
    double alpha = 8;    // lora_alpha: W + (alpha / r)·B·A
    double dropout = 0;  // 0 only: LoRA runs as a weight transform, which cannot drop inputs
    std::vector<std::string> target_modules{"all-linear"};  // PEFT's names, or all-linear
  } lora;
  struct Logging {
    std::string metrics;      // JSONL file (default: <checkpoint.dir>/metrics.jsonl)
    int64_t every = 1;        // steps between plain progress lines when not on a terminal
    std::string tensorboard;  // a folder for TensorBoard event files ("": none; tensorboard.h)
  } logging;
  // Evaluation during training (src/runtime/finetune_eval.h): on held-out rows every `every`
  // steps and at the last, the loss (the training loss, no backward) and, with `accuracy`, each
  // row's question answered as lvx qa answers it and scored; lines in logging.metrics.
  struct Eval {
    std::string data;      // JSONL of held-out rows, data.train's formats ("": no eval)
    int64_t every = 0;     // steps between evaluations (0: only after the last step)
    int64_t max_rows = 0;  // the first max_rows rows (0: all)
    bool accuracy = true;  // also generate answers and score them (rows with an answer)
    int64_t max_new_tokens = 32;
    // eval_loss (lower is better) or eval_accuracy (higher): every evaluation then also saves a
    // checkpoint, and `best.json` in checkpoint.dir names the best, which checkpoint.keep never
    // removes. "": no best checkpoint.
    std::string best_metric;
  } eval;
};

// Bounds of the fields that size an allocation or a process count, checked while loading.
constexpr int64_t kMaxFrames = 4096;                     // data.num_frames: frames of one sample
constexpr double kMaxFps = 240;                          // data.fps
constexpr int64_t kMaxRanks = 1024;                      // parallel.nproc: local processes
constexpr int64_t kMaxSeed = int64_t{1} << 52;           // data.seed (+ epoch must not overflow)
constexpr uint64_t kMaxConfigBytes = uint64_t{1} << 20;  // the run YAML
constexpr int64_t kMaxGradAccum = int64_t{1} << 20;      // optimizer.grad_accum: samples per step
constexpr int64_t kMaxEvalTokens = 4096;                 // eval.max_new_tokens

// Reads `path` and applies `overrides` ("section.field=value", the value parsed as YAML) in
// order. Errors name the file (or "command line") and the field path: unknown fields, wrong
// types, out-of-range values, a missing required field.
TrainConfig load_train_config(const std::string& path, const std::vector<std::string>& overrides);

// The effective configuration as YAML (every field, defaults filled in).
std::string to_yaml(const TrainConfig& c);

// to_yaml's text read back (the config a checkpoint recorded); errors name `where`.
TrainConfig train_config_from_yaml(const std::string& text, const std::string& where);

// The fields of data, optimizer, schedule, freeze and lora that differ from `before` to `now`, each
// as "section.field: old -> new" (what --resume refuses unless told to accept them).
std::vector<std::string> config_changes(const TrainConfig& before, const TrainConfig& now);

}  // namespace lvx::runtime
