// `lvx finetune`: what is checked before and while ranks start (finetune_job.h): the rows, the
// resume state, the job. The run itself is finetune_rank.cpp's steps.
#include "src/runtime/finetune_job.h"

#include <ATen/core/grad_mode.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>
#include <tuple>

#include "models/checkpoint.h"
#include "models/model.h"
#include "models/tokenizer/tokenizer.h"
#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"
#include "src/dist/process_group.h"
#include "src/runtime/device.h"
#include "src/runtime/finetune_lora.h"
#include "src/runtime/tensorboard.h"
#include "src/runtime/layer_plan.h"
#include "src/runtime/optimizer.h"
#include "src/runtime/layer_sharding.h"
#include "src/runtime/sharded_state.h"
#include "src/runtime/train_checkpoint.h"
#include "src/runtime/train_step.h"
#include "video/decoder.h"
#include "video/pipeline.h"

namespace lvx::runtime {

namespace fs = std::filesystem;

void check_model_dir(const std::string& dir, const std::string& field) {
  LVX_CHECK(fs::is_directory(dir), field, ": ", dir, " is not a directory (expected a checkpoint ",
            "directory with config.json, model.safetensors and tokenizer.json)");
  LVX_CHECK(fs::exists(fs::path(dir) / "config.json"), field, ": ", dir,
            " has no config.json (expected a Hugging Face checkpoint directory)");
  LVX_CHECK(fs::exists(fs::path(dir) / "tokenizer.json"), field, ": ", dir,
            " has no tokenizer.json (fine-tuning tokenizes the questions and answers)");
}

// A metrics file may be continued only by the run that wrote it (a resume whose checkpoint
// recorded the same file); any other run would mix or, resuming, cut its rows.
void check_metrics_file(const TrainConfig& cfg, const std::string& recorded) {
  const std::string& m = cfg.logging.metrics;
  check_output_path(m, "logging.metrics");
  if (!recorded.empty() && recorded == m) return;
  std::error_code ec;
  const auto size = fs::exists(m, ec) ? fs::file_size(m, ec) : 0;
  LVX_CHECK(ec || size == 0, "logging.metrics: ", m, " already holds ", size,
            " bytes of metrics that this run did not write",
            recorded.empty() ? "" : str(" (its checkpoint recorded ", recorded, ")"),
            "; a run never overwrites another's metrics: give logging.metrics another file (the ",
            "default is <checkpoint.dir>/metrics.jsonl), or remove that one");
}

namespace {

// The step of a checkpoint folder's name (step-000042 → 42), −1 when it has another name.
int64_t step_of_name(const std::string& dir) {
  const std::string n = fs::path(dir).filename().string();
  if (n.size() < 6 || n.rfind("step-", 0) != 0) return -1;
  int64_t v = 0;
  for (size_t i = 5; i < n.size(); ++i) {
    if (n[i] < '0' || n[i] > '9' || v > (int64_t{1} << 40)) return -1;
    v = v * 10 + (n[i] - '0');
  }
  return v;
}

}  // namespace

namespace {

// A row's system message goes through the family's template (OpenFlamingo and
// Llama-3.2-Vision have no place for one and refuse it): rendered once per such row before
// anything runs. The family and tokenizer are read on the first such row.
class SystemCheck {
 public:
  explicit SystemCheck(const std::string& model_dir) : dir_(model_dir) {}
  void operator()(const QaItem& it, const std::string& where) {
    if (it.system.empty()) return;
    if (!tok_) {
      const std::string c = dir_ + "/config.json";
      family_ = &models::family_of_config(read_json_file(c, "model config"), c);
      tok_ = std::make_unique<models::Tokenizer>(
          models::Tokenizer::from_file(dir_ + "/tokenizer.json"));
    }
    try {
      training_prompt(*family_, *tok_, it, 1);
    } catch (const Error& e) {
      LVX_FAIL(where, ": ", e.what());
    }
  }

 private:
  std::string dir_;
  std::unique_ptr<models::Tokenizer> tok_;
  const models::Family* family_ = nullptr;
};

// A row's time range lies inside its video (each video probed once).
class RangeCheck {
 public:
  void operator()(const QaItem& it, const std::string& where) {
    auto sp = spans_.find(it.video);
    if (sp == spans_.end()) {
      const video::VideoDecoder dec(it.video);
      sp = spans_.emplace(it.video, std::make_pair(dec.info().begin_seconds,
                                                   dec.info().end_seconds))
               .first;
    }
    const auto [begin, end] = sp->second;
    if (it.start)
      LVX_CHECK(*it.start < end, where, ": field 'start' (", *it.start,
                " s) is at or after the end of ", it.video, " (", end, " s)");
    if (it.end)
      LVX_CHECK(*it.end <= end + 1e-3 && *it.end > begin, where, ": field 'end' (", *it.end,
                " s) is outside ", it.video, " (", begin, " to ", end, " s)");
  }

 private:
  std::map<std::string, std::pair<double, double>> spans_;  // video → [begin, end] seconds
};

// The rows of `path` (config field `field`), every one checked (load_training_data).
std::vector<QaItem> load_rows(const TrainConfig& cfg, const std::string& path,
                              const std::string& field, bool probe_videos,
                              std::vector<int64_t>* lines) {
  try {
    check_regular_file(path, field);
  } catch (const Error& e) {
    LVX_FAIL(e.what(), " (expected a JSONL file of question rows with answers)");
  }
  std::vector<QaItem> items;
  std::string errors;
  int bad = 0;
  SystemCheck check_system(cfg.model.path);
  RangeCheck check_range;
  // One row at most 1 MiB (a question and its answer), nested at most 64 levels.
  for (QaLine& l : read_qa_rows(path, field, /*need_answer=*/true, uint64_t{1} << 20)) {
    const std::string where = str(path, ":", l.line);
    try {
      if (!l.error.empty()) throw Error(l.error);
      QaItem& it = l.item;
      try {
        check_regular_file(it.video, "video");
      } catch (const Error& e) {
        LVX_FAIL(where, ": field 'video': ", e.what());
      }
      if (probe_videos) {
        check_system(it, where);
        check_range(it, where);
      }
      items.push_back(std::move(it));
      if (lines) lines->push_back(l.line);
    } catch (const Error& e) {
      if (bad++ < 5) errors += str("\n  ", e.what());
    }
  }
  LVX_CHECK(bad == 0, field, ": ", bad, " unusable row(s) in ", path, ":", errors,
            bad > 5 ? "\n  ..." : "");
  LVX_CHECK(!items.empty(), field, ": ", path, " has no rows");
  return items;
}

}  // namespace

std::vector<QaItem> load_training_data(const TrainConfig& cfg, bool probe_videos,
                                       std::vector<int64_t>* lines) {
  return load_rows(cfg, cfg.data.train, "data.train", probe_videos, lines);
}

std::vector<QaItem> load_eval_data(const TrainConfig& cfg, bool probe_videos,
                                   std::vector<int64_t>* lines) {
  if (cfg.eval.data.empty()) return {};
  std::vector<QaItem> items = load_rows(cfg, cfg.eval.data, "eval.data", probe_videos, lines);
  const auto keep = static_cast<size_t>(cfg.eval.max_rows);
  if (keep > 0 && items.size() > keep) {
    items.resize(keep);
    if (lines) lines->resize(keep);
  }
  return items;
}

namespace {

// A resume keeps the recorded run's global batch (`batch` samples per step over `groups`
// data-parallel groups): optimizer.grad_accum follows from it and the groups this resume has,
// and a change is said; a number of groups that cannot keep it is refused by name. With
// --accept-config-changes a configured optimizer.grad_accum other than the recorded one sets a
// new batch (listed as a change). Returns the config the resume compares with the recorded one.
TrainConfig keep_global_batch(const TrainConfig& before, int64_t batch, int64_t groups,
                              const TrainConfig& cfg, bool accept, ResumeState& r) {
  TrainConfig compared = cfg;
  compared.optimizer.grad_accum = before.optimizer.grad_accum;  // the batch decides it
  if (accept && cfg.optimizer.grad_accum != before.optimizer.grad_accum) {
    compared.optimizer.grad_accum = cfg.optimizer.grad_accum;
    return compared;
  }
  const int64_t sp = cfg.parallel.sp_size > 0 ? cfg.parallel.sp_size : cfg.parallel.nproc;
  const int64_t dp = std::max<int64_t>(1, cfg.parallel.nproc / std::max<int64_t>(1, sp));
  if (cfg.optimizer.grad_accum * dp == batch) return compared;
  LVX_CHECK(batch % dp == 0, "--resume: the run's global batch is ", batch, " samples per step (",
            "optimizer.grad_accum ", before.optimizer.grad_accum, " x ", groups,
            " data-parallel group(s)); ", dp, " groups (parallel.nproc ", cfg.parallel.nproc,
            " / sp_size ", sp, ") cannot keep it: use a number of groups that divides ", batch,
            ", or set optimizer.grad_accum and pass --accept-config-changes to change the batch");
  r.grad_accum = batch / dp;
  r.note = str("--resume: ", dp, " data-parallel group(s), the run had ", groups,
               ": optimizer.grad_accum ", cfg.optimizer.grad_accum, " -> ", r.grad_accum,
               " keeps the global batch of ", batch, " samples per step");
  return compared;
}

}  // namespace

ResumeState check_resume_state(const TrainConfig& cfg, const std::string& ckpt, int64_t samples,
                               bool accept_config_changes) {
  const std::string where = ckpt + "/trainer_state.json";
  const nlohmann::json st = read_json_file(where, "trainer state", uint64_t{16} << 20);
  auto field = [&](const nlohmann::json& obj, const char* key, const char* path) {
    LVX_CHECK(obj.is_object() && obj.contains(key), where, ": missing field '", path, "'");
    return obj[key];
  };
  auto integer = [&](const nlohmann::json& obj, const char* key, const char* path, int64_t min) {
    const nlohmann::json v = field(obj, key, path);
    LVX_CHECK(v.is_number_integer(), where, ": field '", path, "' must be an integer, got ",
              v.dump());
    const int64_t x = v.get<int64_t>();
    LVX_CHECK(x >= min, where, ": field '", path, "' must be >= ", min, ", got ", x);
    return x;
  };
  ResumeState r;
  r.step = integer(st, "step", "step", 1);
  const int64_t named = step_of_name(ckpt);
  LVX_CHECK(named < 0 || named == r.step, where, ": field 'step' is ", r.step,
            " but the checkpoint is ", fs::path(ckpt).filename().string());
  const nlohmann::json data = field(st, "data", "data");
  LVX_CHECK(data.is_object(), where, ": field 'data' must be an object");
  const int64_t rows = integer(data, "samples", "data.samples", 1);
  LVX_CHECK(rows == samples, where, ": the run trained on ", rows, " rows of ",
            data.value("train", std::string("?")), "; ", cfg.data.train, " now has ", samples,
            " (the data order would change; resume with the same data)");
  const int64_t world_before = integer(st, "world_size", "world_size", 1);
  const nlohmann::json text = field(st, "config", "config");
  LVX_CHECK(text.is_string(), where, ": field 'config' must be the run's YAML as a string");
  const TrainConfig before = train_config_from_yaml(text.get<std::string>(), where + ": config");
  // The data position must be the one the recorded run reached at this step: grad_accum samples
  // per data-parallel group (world / sp_size of them) per step.
  const int64_t seen = integer(data, "samples_seen", "data.samples_seen", 0);
  const int64_t sp_before = before.parallel.sp_size > 0 ? before.parallel.sp_size : world_before;
  LVX_CHECK(world_before % sp_before == 0, where, ": world_size ", world_before,
            " is not a multiple of its config's parallel.sp_size ", sp_before);
  const int64_t per_step = before.optimizer.grad_accum * (world_before / sp_before);
  LVX_CHECK(r.step <= (int64_t{1} << 40) / per_step && seen == r.step * per_step, where,
            ": field 'data.samples_seen' is ", seen, ", but step ", r.step, " with grad_accum ",
            before.optimizer.grad_accum, " and ", world_before / sp_before,
            " data-parallel group(s) has seen ", r.step * per_step);
  r.samples_seen = seen;
  LVX_CHECK(integer(data, "epoch", "data.epoch", 0) == seen / rows &&
                integer(data, "position", "data.position", 0) == seen % rows,
            where, ": fields 'data.epoch' and 'data.position' do not match ", seen,
            " samples seen of ", rows);
  LVX_CHECK(integer(data, "seed", "data.seed", 0) == before.data.seed, where,
            ": field 'data.seed' differs from its config's data.seed ", before.data.seed);
  r.metrics = before.logging.metrics;
  const TrainConfig now = keep_global_batch(before, per_step, world_before / sp_before, cfg,
                                            accept_config_changes, r);
  // The default file lives with the checkpoints: a run folder that was moved or copied keeps it.
  if (before.logging.metrics == before.checkpoint.dir + "/metrics.jsonl" &&
      cfg.logging.metrics == cfg.checkpoint.dir + "/metrics.jsonl")
    r.metrics = cfg.logging.metrics;
  const std::vector<std::string> changes = config_changes(before, now);
  if (!changes.empty() && !accept_config_changes) {
    std::string list;
    for (const auto& c : changes) list += "\n  " + c;
    LVX_FAIL("--resume: the configuration differs from the one ",
             fs::path(ckpt).filename().string(), " was trained with (", where, "):", list,
             "\nresume with the same settings, or pass --accept-config-changes to continue ",
             "with the new ones");
  }
  return r;
}

TrainConfig validate_finetune_job(const FinetuneJob& job) {
  check_device_option(job.device);  // counts: by the launcher and on each rank
  const TrainConfig cfg = load_train_config(job.config, job.overrides);
  check_model_dir(cfg.model.path, "model.path");
  if (cfg.parallel.strategies != "auto") explicit_strategies(cfg.parallel.strategies, 1);
  LVX_CHECK(cfg.parallel.sp_size == 0 || cfg.parallel.nproc % cfg.parallel.sp_size == 0,
            "parallel.sp_size: ", cfg.parallel.sp_size, " does not divide the ",
            cfg.parallel.nproc, " ranks (world = data-parallel groups × sp_size)");
  if (!cfg.parallel.cluster.empty()) check_regular_file(cfg.parallel.cluster, "parallel.cluster");
  const int64_t samples =
      static_cast<int64_t>(load_training_data(cfg, /*probe_videos=*/true).size());
  load_eval_data(cfg, /*probe_videos=*/true);
  const std::string latest = latest_checkpoint(cfg.checkpoint.dir);
  std::string recorded_metrics;
  if (!job.resume) {
    LVX_CHECK(latest.empty(), "checkpoint.dir: ", cfg.checkpoint.dir, " already holds checkpoints ",
              "(latest: ", fs::path(latest).filename().string(), "); pass --resume to continue ",
              "that run, or choose another checkpoint.dir (nothing is overwritten)");
  } else if (!latest.empty()) {
    verify_checkpoint(latest);
    const ResumeState resumed = check_resume_state(cfg, latest, samples, job.accept_config_changes);
    recorded_metrics = resumed.metrics;
    if (!resumed.note.empty()) std::cout << resumed.note << "\n" << std::flush;
  }
  check_metrics_file(cfg, recorded_metrics);
  return cfg;
}

}  // namespace lvx::runtime
