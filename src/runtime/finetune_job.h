// `lvx finetune`: supervised fine-tuning on video question answering, data × sequence parallel.
// Within a sequence-parallel group (parallel.sp_size ranks) every rank decodes and encodes only
// its own share of each sample's frames (the model's key layout) and holds its share of the
// text; the planner (or parallel.strategies) picks each layer's attention strategy; the groups
// take different samples. Gradients are summed across all ranks and the optimizer state is
// replicated or sharded (parallel.shard: ZeRO stages 1-3). The run's steps are in
// finetune_rank.h; evaluation during training in finetune_eval.h (docs/finetune.md).
//
// Determinism: the sample of optimizer step s, micro-batch a is sample k = s · grad_accum + a of
// the concatenated per-epoch orders (a permutation seeded with data.seed + epoch, or file order
// without shuffle), so the data order follows from the step alone; a resumed run repeats the
// interrupted run's arithmetic and, on CPU with the same rank count, reaches bitwise the same
// parameters (tests/test_runtime_finetune.cpp).
#pragma once

#include <string>
#include <vector>

#include "src/runtime/train_config.h"
#include "src/runtime/video_qa.h"

namespace lvx::runtime {

struct FinetuneJob {
  std::string config;                  // run YAML
  std::vector<std::string> overrides;  // "section.field=value"
  bool resume = false;                 // continue from checkpoint.dir/latest (fresh if none)
  // --resume with data, optimizer, schedule or freeze settings that differ from the ones the
  // checkpoint recorded: refused (naming the fields) unless this is set.
  bool accept_config_changes = false;
  std::string device = "auto";  // auto | cuda | cpu (src/runtime/device.h); model.dtype as given
};

// The training rows, every one checked: a bad row, a missing video or a time range outside its
// video is an error naming the file:line (several at once when several rows are bad). Rows are
// read by read_qa_rows (src/runtime/qa_rows.h; a line at most 1 MiB, JSON nested at most 64
// levels). `lines`, when given, gets each item's line number.
std::vector<QaItem> load_training_data(const TrainConfig& cfg, bool probe_videos,
                                       std::vector<int64_t>* lines = nullptr);
// The held-out rows of eval.data (the first eval.max_rows), checked the same way; none without
// an `eval:` section.
std::vector<QaItem> load_eval_data(const TrainConfig& cfg, bool probe_videos,
                                   std::vector<int64_t>* lines = nullptr);

// What --resume continues from, read from the checkpoint's trainer_state.json and checked:
// types and ranges (step >= 1 and the folder's step, the data position consistent with it, the
// row count equal to the data's now), and the recorded config against `cfg` (changes to data,
// optimizer, schedule or freeze are refused, naming the fields, unless accepted).
struct ResumeState {
  int64_t step = 0;
  int64_t samples_seen = 0;  // data position: samples taken by every data-parallel group together
  std::string metrics;       // the recorded run's logging.metrics
  // With another number of data-parallel groups than the recorded run: the optimizer.grad_accum
  // that keeps its global batch (0: unchanged), and the sentence that says so.
  int64_t grad_accum = 0;
  std::string note;
};
ResumeState check_resume_state(const TrainConfig& cfg, const std::string& ckpt, int64_t samples,
                               bool accept_config_changes);

// Checks everything before ranks start and before anything is written: the config, the model
// directory (config.json, tokenizer.json), the data, and the checkpoint directory (a fresh run
// refuses a directory that already holds checkpoints; --resume verifies the latest one). Returns
// the config.
TrainConfig validate_finetune_job(const FinetuneJob& job);

// Runs on this rank (rendezvous from the environment). Returns 0 on success.
int run_finetune_rank(const FinetuneJob& job);

}  // namespace lvx::runtime
