// One rank's `lvx finetune` run (finetune_job.h), as the named steps run_finetune_rank takes:
//
//   open_run          the groups (data × sequence parallel), the config, the rows, the resume point
//   load_run_model    the model (stage 3: decoder layers left unread), LoRA, tokenizer, context
//   choose_trainable  what trains (LoRA's adapter, or freeze.policy's parameters)
//   init_optimizer    AdamW, whole or sharded (parallel.shard)
//   restore_state     resuming: the optimizer state and the fp32 masters into the model
//   shard_layers      stages 2 and 3: the layer-by-layer engine (layer_sharding.h)
//   open_logs         metrics.jsonl (cut back to the resume step), TensorBoard, the header line
//   then per step:    train_step, log_step, evaluate (finetune_eval.h), save_checkpoint
//
// RankRun holds what the steps share; each step reads what it needs and sets its own part.
// Internal to the fine-tuning job (finetune_job.cpp, finetune_rank.cpp, finetune_step.cpp,
// finetune_eval.cpp).
#pragma once

#include <chrono>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/checkpoint.h"
#include "models/model.h"
#include "models/tokenizer/tokenizer.h"
#include "src/planner/train_flops.h"
#include "src/runtime/finetune_job.h"
#include "src/runtime/layer_sharding.h"
#include "src/runtime/optimizer.h"
#include "src/runtime/sample_prefetch.h"
#include "src/runtime/sharded_state.h"
#include "src/runtime/tensorboard.h"
#include "video/video_options.h"

namespace lvx::dist {
class ProcessGroup;
}

namespace lvx::runtime {

struct RankRun {
  // open_run: who this rank is. Consecutive ranks form the sequence-parallel groups (a node's
  // ranks are consecutive, so a group stays inside a node when sp divides its size).
  std::shared_ptr<dist::ProcessGroup> pg, sp_pg;
  int n = 1, r = 0;            // world
  int sp = 1, dp = 1;          // sequence-parallel size, data-parallel groups
  int group = 0, sp_rank = 0;  // this rank's data-parallel group and place in it
  int64_t base_rss = 0;        // peak RSS before the model (the libraries)
  TrainConfig cfg;
  ShardStage stage = ShardStage::kNone;
  bool stage3 = false, sharded = false, lora = false;
  std::vector<QaItem> items;   // data.train
  std::vector<int64_t> lines;  // each item's line
  int64_t samples = 0;
  std::string ckpt;  // resuming from (empty: fresh)
  ResumeState resumed;
  int64_t start = 0, seen0 = 0;  // first step, samples seen before it

  // load_run_model
  std::string model_dir;
  at::Device device{at::kCPU};
  at::ScalarType dtype = at::kFloat;
  std::unique_ptr<models::Model> model;
  std::shared_ptr<const models::CheckpointIndex> index;  // stage 3: where the unread ones are
  std::unique_ptr<models::Tokenizer> tok;
  std::map<std::string, std::string> model_files;
  video::PreprocessConfig prep;
  int64_t context = 0;

  // choose_trainable, init_optimizer, shard_layers
  std::map<std::string, at::Tensor> trainable;
  int64_t trainable_numel = 0, total_numel = 0;
  FlatLayout layout;
  std::unique_ptr<AdamW> opt;          // parallel.shard none
  std::unique_ptr<ShardedAdamW> sopt;  // every other stage (constructed always, as its layout)
  std::unique_ptr<LayerSharding> layered;

  // open_logs
  std::ofstream metrics;  // rank 0
  std::unique_ptr<TensorBoardWriter> tensorboard;
  bool plain =
      true;  // plain progress lines (the launcher draws a bar when it sets LVX_FINETUNE_BAR)
  std::chrono::steady_clock::time_point t_run;
  int64_t tokens_run = 0;

  // price_flops: the model's shapes for each sample's model FLOPs (planner/train_flops.h) and
  // the run's devices' peak FLOP/s (0: no parallel.cluster to read it from), for the MFU logged
  ModelConfig flops_model;
  planner::SampleShape flops_shape;  // frames and text tokens set per sample
  double peak_flops = 0;
  // The planner's collectives of one optimizer step on the cluster's links
  // (planner/train_traffic.h: the stage's all-reduces, reduce-scatters and gathers; < 0: no
  // parallel.cluster). A step's predicted time is its model FLOPs at peak_flops plus these.
  double step_traffic_s = -1;

  // start_prefetch: the next samples prepared on workers while a step computes (data.prefetch)
  std::unique_ptr<SamplePrefetch> prefetch;
};

// What one optimizer step did (train_step), for log_step.
struct StepResult {
  double loss = 0, norm = 0, seconds = 0;
  // Rank 0's: preparing its samples (decode, preprocessing, prompt: on the prefetch's workers or
  // here) and the step's wait for them (all of the former without prefetch).
  double input_s = 0, input_wait_s = 0;
  double model_flops = 0;          // global: every data-parallel group's samples (train_flops.h)
  int64_t tokens = 0, frames = 0;  // global: every data-parallel group's
  int64_t state_bytes = 0;         // this rank's bytes for the training state
};

// ---- the steps (finetune_rank.cpp) ----------------------------------------------------------
RankRun open_run(const FinetuneJob& job);
void load_run_model(RankRun& run, const FinetuneJob& job);
void choose_trainable(RankRun& run);
void init_optimizer(RankRun& run);
void restore_state(RankRun& run);
void shard_layers(RankRun& run);
void open_logs(RankRun& run);
void price_flops(RankRun& run);

// ---- each step (finetune_step.cpp) ----------------------------------------------------------
StepResult train_step(RankRun& run, int64_t step);
void log_step(RankRun& run, int64_t step, const StepResult& s);
// The checkpoint of `step` (parameters or adapter, optimizer state, trainer state). Collective.
void save_checkpoint(RankRun& run, int64_t step);
// checkpoint.every says so, or the last step.
bool checkpoint_due(const RankRun& run, int64_t step);

// ---- shared helpers (finetune_job.cpp, finetune_step.cpp) ------------------------------------
// Peak resident memory of this process so far (getrusage ru_maxrss), bytes.
int64_t peak_rss_bytes();
void check_model_dir(const std::string& dir, const std::string& field);
void check_metrics_file(const TrainConfig& cfg, const std::string& recorded);
// Every rank's outcome of its local work for one sample: when any failed, every rank throws at
// once naming the failed ranks and their errors (instead of waiting in the next collective).
void agree_on_errors(dist::ProcessGroup& pg, const std::string& error, const std::string& what);
// Rank 0 writes while the others wait for as long as the write takes (not the timeout).
void rank0_writes(dist::ProcessGroup& pg, int64_t step, const std::function<void()>& write);
// The frames and the prompt with its answer of `item`, this rank's share: what a training step
// and the held-out loss both run on. A failure (the video, the prompt, the model's context) on
// any rank of the sequence-parallel group stops all of them, each naming `what`.
struct SampleInputs {
  at::Tensor ids, labels, pixels;  // ids, labels [1, L] (host), pixels on the device or undefined
  int64_t tokens = 0, frames = 0;
};
SampleInputs sample_inputs(const RankRun& run, const QaItem& item, const std::string& what);
// sample_inputs in two parts: this rank's own work (prepare_sample: no collective, run by the
// prefetch's workers too), then the agreement on errors and the tensors (agreed_inputs).
LocalSample prepare_sample(const RankRun& run, const QaItem& item);
SampleInputs agreed_inputs(const RankRun& run, LocalSample local, const std::string& what);
// The prefetch of the training samples this rank takes (data.prefetch > 0), from the run's
// (or the resumed) first step on.
void start_prefetch(RankRun& run);

}  // namespace lvx::runtime
