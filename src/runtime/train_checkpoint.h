// Fine-tuning checkpoints: each one is a Hugging Face checkpoint directory that `lvx qa`,
// `lvx forward` and models::load_model read as they are (config.json, tokenizer.json,
// model.safetensors), plus the training state that --resume needs (optimizer.safetensors: fp32
// masters and AdamW moments; trainer_state.json: step, data order, effective config) and
// manifest.json (size and XXH3-64 checksum of every other file; lvx::verify_manifest also
// accepts the FNV-1a 64 entries of checkpoints written before).
//
// Layout under checkpoint.dir:
//   step-000004/      a complete checkpoint
//   step-000006.partial/   one being written (or left by a crash; never read, removed later)
//   latest            one line: the name of the newest complete checkpoint
//   best.json         with eval.best_metric: the best checkpoint by it (finetune_eval.h), which
//                     `keep` never removes
// Writes are atomic: the files go into <name>.partial, each is fsynced, manifest.json last, then
// the folder is renamed into place and the parent fsynced, and only then is `latest` replaced
// (write latest.tmp, fsync, rename, fsync the parent). A crash at any moment leaves `latest`
// naming a complete checkpoint (or absent before the first one). Old checkpoints beyond `keep`
// are removed only after `latest` names the new one.
//
// Fault injection for tests goes through train_faults.h: a test's hooks may act before the first
// file ("slow"), after it ("after_first_file") and after the rename, before `latest` is updated
// ("before_latest").
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace lvx::runtime {

std::string checkpoint_name(int64_t step);  // "step-000042"

// The non-weight files of a checkpoint directory (config.json, tokenizer.json, ...) by name, read
// once at start: the directory they came from may be an old checkpoint that `keep` removes.
std::map<std::string, std::string> read_model_files(const std::string& model_dir);

// Writes checkpoint `step` under `root` as above. `model_files`: read_model_files() of the
// directory the model came from (written as they are). `params`: every
// parameter of the model (saved in its dtype under the checkpoint names); `optimizer`: the
// optimizer's state tensors; `state`: trainer_state.json. Returns the checkpoint's path.
// Sharded training state (sharded_state.h): begin_train_checkpoint clears leftovers and creates
// the empty <root>/step-NNNNNN.partial/ (returned) for every rank to write its optimizer shard
// into; save_train_checkpoint then gets those file names as `present` (listed in the manifest,
// the folder not cleared again) and an empty `optimizer` (no optimizer.safetensors).
// LoRA: `weights_file` "adapter_model.safetensors", `params` the adapter's tensors and
// `model_files` its adapter_config.json (a PEFT adapter directory; no config.json needed).
std::string save_train_checkpoint(const std::string& root, int64_t step,
                                  const std::map<std::string, std::string>& model_files,
                                  const std::map<std::string, at::Tensor>& params,
                                  const std::map<std::string, at::Tensor>& optimizer,
                                  const nlohmann::json& state, int64_t keep,
                                  const std::vector<std::string>& present = {},
                                  const std::string& weights_file = "model.safetensors");
std::string begin_train_checkpoint(const std::string& root, int64_t step);

// The complete checkpoint folders under `root` (step-NNNNNN, sorted; no .partial ones).
std::vector<std::string> checkpoint_folders(const std::string& root);

// The newest complete checkpoint under `root` (`latest`), or "" when there is none. A `latest`
// that is unreadable or names a missing folder, and a missing `latest` while step folders remain
// (a deleted pointer: guessing could resume from, or a fresh start remove, checkpoints the user
// wants), are errors naming the directory.
std::string latest_checkpoint(const std::string& root);

// A model or adapter folder as jobs take it: `name` itself; a Hugging Face name (org/name[@rev])
// that is no folder here, its snapshot in the local hub cache (src/runtime/hub_cache.h); and for
// a run folder (no config.json or adapter_config.json of its own, a `latest` pointer), the
// checkpoint its `latest` names (said once on stderr). Errors as latest_checkpoint's.
std::string follow_run_folder(const std::string& name);

// best.json under `root`: the best checkpoint by an evaluation metric.
struct BestCheckpoint {
  std::string checkpoint;  // folder name, e.g. step-000040
  int64_t step = 0;
  std::string metric;      // eval_loss | eval_accuracy
  double value = 0;
};
// None when there is no best.json; an unreadable one is an error naming it.
std::optional<BestCheckpoint> read_best_checkpoint(const std::string& root);
// Atomically (best.json.tmp, fsync, rename, fsync the folder).
void write_best_checkpoint(const std::string& root, const BestCheckpoint& best);

// Checks every file of the manifest (present, size, checksum) with lvx::verify_manifest. Throws
// lvx::Error naming the checkpoint and the file that is missing or corrupt, or the missing
// manifest.
void verify_checkpoint(const std::string& dir);

}  // namespace lvx::runtime
