// Evaluation during `lvx finetune` (the run's `eval:` section, TrainConfig::Eval).
//
// After every eval.every-th step and after the last, on the held-out rows of eval.data (read and
// checked before ranks start, like data.train):
//   eval_loss      the training loss without a backward: each row's prompt with its answer, the
//                  same frames (data.num_frames / data.fps), the same forward; the mean over rows
//                  of each row's mean token loss (Hugging Face Trainer's eval_loss at batch 1);
//   eval_accuracy  with eval.accuracy, each row's question answered through lvx qa's own path
//                  (QaSession::answer over the model being trained, its LoRA branches included;
//                  greedy, eval.max_new_tokens) and scored as lvx qa scores it (parsed option
//                  letter or the answer text): correct / rows with an answer.
// Data-parallel groups split the rows (row i goes to group i mod groups); the sums are reduced
// over the world. At parallel.shard parameters the forward gathers each layer as training does
// (every group runs the same number of forwards, the last ones repeated without counting); the
// accuracy is refused there by the config (generation would gather every layer per token).
//
// One line per evaluation in logging.metrics: {step, eval_loss, eval_accuracy (when scored),
// eval_rows, eval_scored, eval_correct, eval_errors, eval_seconds}, and eval/loss, eval/accuracy
// in TensorBoard. With eval.accuracy, the answers themselves (lvx qa's rows, in eval.data's
// order) go to <checkpoint.dir>/eval/step-NNNNNN.jsonl. With eval.best_metric every evaluation's step is also checkpointed and
// `best.json` in checkpoint.dir ({checkpoint, step, metric, value}, written atomically) names the
// best checkpoint so far, which checkpoint.keep never removes (train_checkpoint.h). A resumed
// run continues from the recorded best.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "src/runtime/finetune_rank.h"

namespace lvx::runtime {

class QaSession;

class Evaluator {
 public:
  // Reads eval.data (nothing without an `eval:` section) and, resuming, the recorded best.
  explicit Evaluator(RankRun& run);
  ~Evaluator();
  // An evaluation follows `step` (0-based): eval.every divides step + 1, or it is the last.
  bool due(int64_t step) const;
  // Evaluates after `step` on every rank (collective); rank 0 writes the metrics line and prints
  // a summary.
  void run(int64_t step);
  bool keeps_best() const;
  // After the checkpoint of `step` is complete: best.json names it when this evaluation is the
  // best so far (rank 0 writes).
  void record_best(int64_t step);

 private:
  struct Sums {
    double loss = 0;  // Σ per-row mean loss (rows this rank's group evaluated, once per group)
    int64_t rows = 0, scored = 0, correct = 0, errors = 0;
  };
  void add_loss(Sums& sums);
  void add_accuracy(Sums& sums);
  void write_line(int64_t step, const Sums& all, double seconds);
  void write_answers(int64_t step);

  RankRun& run_;
  std::vector<QaItem> rows_;
  std::vector<int64_t> lines_;
  std::unique_ptr<QaSession> session_;
  std::vector<std::string> answers_;  // this group's [row, answer] lines (its first rank)
  std::optional<double> value_;  // this evaluation's eval.best_metric
  std::optional<double> best_;   // the best so far
};

}  // namespace lvx::runtime
