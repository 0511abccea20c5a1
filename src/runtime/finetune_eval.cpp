// Evaluation during `lvx finetune` (finetune_eval.h).
#include "src/runtime/finetune_eval.h"

#include <ATen/core/grad_mode.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>

#include "src/common/error.h"
#include "src/dist/process_group.h"
#include "src/runtime/layer_plan.h"
#include "src/runtime/qa_job.h"
#include "src/runtime/train_checkpoint.h"
#include "src/runtime/train_step.h"

namespace lvx::runtime {

namespace {

// lvx qa's job for the model being trained: its directory, dtype and strategies, the run's
// frames, greedy answers of at most eval.max_new_tokens.
QaJob eval_qa_job(const RankRun& run) {
  const TrainConfig& cfg = run.cfg;
  QaJob job;
  job.model = run.model_dir;
  job.num_frames = cfg.data.num_frames;
  job.fps = cfg.data.fps;
  job.generation.max_new_tokens = cfg.eval.max_new_tokens;
  job.plan = {cfg.parallel.strategies, cfg.parallel.cluster, cfg.model.dtype, /*train=*/false};
  job.device = run.device.is_cuda() ? "cuda" : "cpu";
  return job;
}

bool better(const std::string& metric, double a, double b) {
  return metric == "eval_loss" ? a < b : a > b;
}

// Every rank's `text`, concatenated in rank order (two all-gathers: the sizes, the bytes).
std::string gather_text(dist::ProcessGroup& pg, const std::string& text) {
  const at::Tensor size = at::tensor({static_cast<int64_t>(text.size())}, at::kLong);
  const at::Tensor sizes = pg.all_gather(size);
  std::vector<int64_t> each(sizes.data_ptr<int64_t>(), sizes.data_ptr<int64_t>() + sizes.numel());
  at::Tensor bytes = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  if (!text.empty()) std::memcpy(bytes.data_ptr<uint8_t>(), text.data(), text.size());
  const at::Tensor all = pg.all_gather(bytes, each).contiguous();
  return std::string(reinterpret_cast<const char*>(all.data_ptr<uint8_t>()),
                     static_cast<size_t>(all.numel()));
}

}  // namespace

Evaluator::Evaluator(RankRun& run) : run_(run) {
  const TrainConfig& cfg = run.cfg;
  rows_ = load_eval_data(cfg, /*probe_videos=*/false, &lines_);
  if (rows_.empty()) return;
  if (cfg.eval.accuracy) session_ = std::make_unique<QaSession>(eval_qa_job(run), run.sp_pg, *run.model);
  if (const auto b = read_best_checkpoint(cfg.checkpoint.dir);
      b && b->metric == cfg.eval.best_metric && !run.ckpt.empty())
    best_ = b->value;
}

Evaluator::~Evaluator() = default;

bool Evaluator::due(int64_t step) const {
  if (rows_.empty()) return false;
  const int64_t every = run_.cfg.eval.every;
  return step + 1 == run_.cfg.schedule.steps || (every > 0 && (step + 1) % every == 0);
}

bool Evaluator::keeps_best() const { return !rows_.empty() && !run_.cfg.eval.best_metric.empty(); }

// Rows i ≡ group (mod groups), each group once: the row's training prompt, the forward, the loss
// (identical on the group's ranks; counted by its first rank). At stage 3 every group runs
// ceil(rows / groups) forwards (the gathers are the world's): the extra ones repeat a row and
// count nothing.
void Evaluator::add_loss(Sums& sums) {
  const int64_t n_rows = static_cast<int64_t>(rows_.size());
  const int64_t per_group = (n_rows + run_.dp - 1) / run_.dp;
  const bool gathers = run_.stage3;
  if (gathers) run_.layered->begin_forward_only();
  for (int64_t i = 0; i < per_group; ++i) {
    const int64_t row = i * run_.dp + run_.group;
    const bool counts = row < n_rows;
    if (!counts && !gathers) break;
    const QaItem& item = rows_[static_cast<size_t>(counts ? row : row % n_rows)];
    const int64_t line = lines_[static_cast<size_t>(counts ? row : row % n_rows)];
    const SampleInputs in = sample_inputs(
        run_, item, str("evaluation, row '", item.id, "' (", run_.cfg.eval.data, ":", line, ")"));
    std::string plan_text;
    models::Parallel par = plan_layers(
        *run_.model, in.ids, run_.sp,
        {run_.cfg.parallel.strategies, run_.cfg.parallel.cluster, run_.cfg.model.dtype, false},
        &plan_text);
    par.pg = run_.sp_pg;
    if (gathers) par.hooks = run_.layered.get();
    const models::ModelOutputs out =
        run_.model->forward({in.ids, in.pixels, /*pixels_local=*/true, {}}, par);
    const double loss = mean_loss(*run_.sp_pg, in.labels, out);
    if (counts && run_.sp_rank == 0) {
      sums.loss += loss;
      ++sums.rows;
    }
  }
  if (gathers) run_.layered->end_forward_only();
}

// The group's rows answered as lvx qa answers them, scored where the row has an answer.
void Evaluator::add_accuracy(Sums& sums) {
  if (!session_) return;
  for (size_t row = static_cast<size_t>(run_.group); row < rows_.size();
       row += static_cast<size_t>(run_.dp)) {
    QaRequest req;
    req.item = rows_[row];
    const nlohmann::json answer = session_->answer(req);
    if (run_.sp_rank != 0) continue;
    answers_.push_back(nlohmann::json::array({row, answer}).dump(-1, ' ', false,
                                                                 nlohmann::json::error_handler_t::replace) +
                       "\n");
    if (answer.contains("error")) {
      ++sums.errors;
      if (sums.errors <= 3)
        std::cerr << "[eval] " << run_.cfg.eval.data << ":" << lines_[row] << ": "
                  << answer["error"].get<std::string>() << "\n";
    } else if (answer.contains("correct")) {
      ++sums.scored;
      sums.correct += answer["correct"].get<bool>() ? 1 : 0;
    }
  }
}

void Evaluator::run(int64_t step) {
  const auto t0 = std::chrono::steady_clock::now();
  Sums mine;
  {
    at::NoGradGuard no_grad;
    add_loss(mine);
    add_accuracy(mine);
  }
  at::Tensor d = at::tensor({mine.loss}, at::kDouble);
  at::Tensor c = at::tensor({mine.rows, mine.scored, mine.correct, mine.errors}, at::kLong);
  run_.pg->all_reduce(d);
  run_.pg->all_reduce(c);
  Sums all{d[0].item<double>(), c[0].item<int64_t>(), c[1].item<int64_t>(), c[2].item<int64_t>(),
           c[3].item<int64_t>()};
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string& metric = run_.cfg.eval.best_metric;
  value_.reset();
  if (metric == "eval_loss" && all.rows > 0) value_ = all.loss / static_cast<double>(all.rows);
  if (metric == "eval_accuracy" && all.scored > 0)
    value_ = static_cast<double>(all.correct) / static_cast<double>(all.scored);
  write_answers(step);
  if (run_.r == 0) write_line(step, all, seconds);
}

// The answers of every group, in row order, as lvx qa writes its rows:
// <checkpoint.dir>/eval/step-NNNNNN.jsonl (rank 0).
void Evaluator::write_answers(int64_t step) {
  if (!session_) return;
  std::string mine;
  for (const std::string& line : answers_) mine += line;
  answers_.clear();
  const std::string all = gather_text(*run_.pg, mine);
  if (run_.r != 0) return;
  std::map<int64_t, nlohmann::json> by_row;
  std::istringstream in(all);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json pair = nlohmann::json::parse(line);
    by_row[pair[0].get<int64_t>()] = pair[1];
  }
  const std::filesystem::path d = std::filesystem::path(run_.cfg.checkpoint.dir) / "eval";
  std::filesystem::create_directories(d);
  const std::string path = (d / (checkpoint_name(step + 1) + ".jsonl")).string();
  std::ofstream f(path + ".tmp", std::ios::trunc);
  for (const auto& [row, answer] : by_row)
    f << answer.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  f.flush();
  LVX_CHECK(f.good(), "eval: cannot write ", path);
  f.close();
  std::filesystem::rename(path + ".tmp", path);
}

void Evaluator::write_line(int64_t step, const Sums& all, double seconds) {
  nlohmann::json m = {{"step", step + 1},
                      {"eval_loss", all.loss / static_cast<double>(std::max<int64_t>(all.rows, 1))},
                      {"eval_rows", all.rows},
                      {"eval_scored", all.scored},
                      {"eval_correct", all.correct},
                      {"eval_errors", all.errors},
                      {"eval_seconds", seconds}};
  const double accuracy =
      all.scored > 0 ? static_cast<double>(all.correct) / static_cast<double>(all.scored) : 0;
  if (all.scored > 0) m["eval_accuracy"] = accuracy;
  run_.metrics << m.dump() << "\n" << std::flush;
  if (run_.tensorboard) {
    run_.tensorboard->scalar("eval/loss", step + 1, m["eval_loss"].get<double>());
    if (all.scored > 0) run_.tensorboard->scalar("eval/accuracy", step + 1, accuracy);
  }
  if (run_.plain) {
    std::printf("eval after step %lld: loss %.4f over %lld rows", static_cast<long long>(step + 1),
                m["eval_loss"].get<double>(), static_cast<long long>(all.rows));
    if (all.scored > 0)
      std::printf(", accuracy %lld/%lld = %.1f%%", static_cast<long long>(all.correct),
                  static_cast<long long>(all.scored), 100.0 * accuracy);
    std::printf(" (%.1f s)\n", seconds);
    std::fflush(stdout);
  }
}

void Evaluator::record_best(int64_t step) {
  const std::string& metric = run_.cfg.eval.best_metric;
  if (metric.empty() || !value_) return;
  if (best_ && !better(metric, *value_, *best_)) return;
  best_ = value_;
  if (run_.r != 0) return;
  write_best_checkpoint(run_.cfg.checkpoint.dir,
                        {checkpoint_name(step + 1), step + 1, metric, *value_});
  if (run_.plain)
    std::cout << "best checkpoint by " << metric << ": " << checkpoint_name(step + 1) << " ("
              << *value_ << ")\n"
              << std::flush;
}

}  // namespace lvx::runtime
