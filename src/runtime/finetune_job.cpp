// `lvx finetune`: the job (finetune_job.h). Over 600 lines, and run_finetune_rank is one long
// function: the structure issue splits it into its named steps (load the model and state, build a
// sample, the step, metrics, checkpoints); it stays whole until then because the fine-tuning
// issues change it meanwhile, and a split under them would be reviewed twice.
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

namespace {

void check_model_dir(const std::string& dir, const std::string& field) {
  LVX_CHECK(fs::is_directory(dir), field, ": ", dir, " is not a directory (expected a checkpoint ",
            "directory with config.json, model.safetensors and tokenizer.json)");
  LVX_CHECK(fs::exists(fs::path(dir) / "config.json"), field, ": ", dir,
            " has no config.json (expected a Hugging Face checkpoint directory)");
  LVX_CHECK(fs::exists(fs::path(dir) / "tokenizer.json"), field, ": ", dir,
            " has no tokenizer.json (fine-tuning tokenizes the questions and answers)");
}

int64_t image_size_of(const std::string& dir) {
  const std::string where = dir + "/config.json";
  const nlohmann::json c = read_json_file(where, "model config");
  LVX_CHECK(c.is_object() && c.contains("vision_config") && c["vision_config"].is_object() &&
                c["vision_config"].contains("image_size") &&
                c["vision_config"]["image_size"].is_number_integer(),
            where, ": vision_config.image_size: missing (the frames are resized to it)");
  return c["vision_config"]["image_size"].get<int64_t>();
}

// Sample k of the run: epochs of `n` samples, each in its own seeded order.
int64_t sample_at(const TrainConfig::Data& d, int64_t n, int64_t k) {
  const int64_t epoch = k / n, pos = k % n;
  if (!d.shuffle) return pos;
  // Per (epoch, row count, seed), made once: an order is a function of all three.
  static std::map<std::tuple<int64_t, int64_t, int64_t>, at::Tensor> orders;
  const auto key = std::make_tuple(epoch, n, d.seed);
  auto it = orders.find(key);
  if (it == orders.end()) {
    at::Generator g =
        at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(d.seed + epoch));
    it = orders.emplace(key, at::randperm(n, g, at::kLong)).first;
  }
  return it->second[pos].item<int64_t>();
}

// LVX_FAULT_KILL=RANK@STEP: this rank kills itself with SIGKILL as optimizer step STEP begins
// (tests of kill-and-resume; the same as `kill -9` from outside at that moment).
void fault_kill(int rank, int64_t step) {
  const char* env = std::getenv("LVX_FAULT_KILL");
  if (!env) return;
  const std::string s = env;
  const size_t at = s.find('@');
  if (at == std::string::npos) return;
  if (std::atoi(s.substr(0, at).c_str()) == rank && std::atoll(s.c_str() + at + 1) == step) {
    std::fprintf(stderr, "LVX_FAULT_KILL=%s: SIGKILL at step %lld\n", env,
                 static_cast<long long>(step));
    std::fflush(stderr);
    ::kill(::getpid(), SIGKILL);
  }
}

// Peak resident memory of this process so far (getrusage ru_maxrss, bytes).
int64_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

std::string hms(double s) {
  const int64_t t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(t / 3600),
                static_cast<long long>(t / 60 % 60), static_cast<long long>(t % 60));
  return buf;
}

// Keeps the metrics of steps up to `step` (a resumed run writes the later ones again). The kept
// lines are written to a new file that replaces the old one, so a kill meanwhile loses nothing;
// a torn last line (a kill mid-write) is dropped.
void truncate_metrics(const std::string& path, int64_t step) {
  if (!fs::exists(path)) return;
  std::string kept;
  JsonlOptions o;
  o.on_torn = [](uint64_t, const std::string&) {};
  for_each_jsonl(
      path, "logging.metrics",
      [&](int64_t, const nlohmann::json& row) {
        const auto s = row.is_object() ? row.find("step") : row.end();
        if (s != row.end() && s->is_number_integer() && s->get<int64_t>() <= step)
          kept += row.dump() + "\n";
      },
      o);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream f(tmp, std::ios::trunc);
    f << kept;
    f.flush();
    LVX_CHECK(f.good(), "logging.metrics: cannot write ", tmp);
  }
  fs::rename(tmp, path);
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

// Every rank's outcome of its local work for one sample (decoding its frames, the prompt): when
// any rank failed, every rank throws at once, naming the failed ranks and their errors, instead
// of the healthy ones waiting in the next collective until the timeout.
void agree_on_errors(dist::ProcessGroup& pg, const std::string& error, const std::string& what) {
  if (pg.world_size() == 1) {
    LVX_CHECK(error.empty(), what, ": ", error);
    return;
  }
  const std::vector<std::string> all = dist::gather_errors(pg, error);
  std::string msg;
  int failed = 0;
  for (int r = 0; r < pg.world_size(); ++r) {
    if (all[static_cast<size_t>(r)].empty()) continue;
    ++failed;
    msg += str("\n  rank ", r, ": ", all[static_cast<size_t>(r)]);
  }
  LVX_CHECK(failed == 0, what, ": failed on ", failed, " of ", pg.world_size(),
            " ranks (every rank stops):", msg);
}

// The ranks with `writes` set write (part of) a checkpoint while the others wait, for as long as
// the writes take rather than the collectives' timeout: each write runs on a thread whose rank's
// main thread tells the others every second (a tenth of the timeout when shorter) whether it is
// done (a small all-reduce of [writing, failed]). A writer that dies still fails the others
// within one timeout; a write that fails fails every rank.
void ranks_write(dist::ProcessGroup& pg, int64_t step, bool writes,
                 const std::function<void()>& write) {
  if (pg.world_size() == 1) return write();
  std::future<void> done;
  if (writes) done = std::async(std::launch::async, write);
  std::exception_ptr failure;
  bool finished = !writes;
  // Well inside the collectives' timeout, at most a second.
  const auto poll = std::clamp(
      std::chrono::duration_cast<std::chrono::milliseconds>(dist::options_from_env().timeout / 10),
      std::chrono::milliseconds(50), std::chrono::milliseconds(1000));
  for (;;) {
    at::Tensor state = at::zeros({2}, at::kLong);  // [ranks still writing, ranks failed]
    if (!finished && done.wait_for(poll) == std::future_status::ready) {
      finished = true;
      try {
        done.get();
      } catch (...) {
        failure = std::current_exception();
        state[1] = 1;
      }
    }
    if (!finished) state[0] = 1;
    pg.all_reduce(state);
    if (state[1].item<int64_t>() > 0) {
      if (failure) std::rethrow_exception(failure);
      LVX_FAIL("another rank could not write its part of the checkpoint of step ", step,
               " (its error is above); the previous checkpoint stays latest");
    }
    if (state[0].item<int64_t>() == 0) return;
  }
}

// Rank 0 writes while the others wait (ranks_write).
void rank0_writes(dist::ProcessGroup& pg, int64_t step, const std::function<void()>& write) {
  ranks_write(pg, step, pg.rank() == 0, write);
}

// The model's context in tokens from its config.json (max_position_embeddings, or max_seq_len
// for MPT), 0 when it names none.
int64_t model_context(const std::map<std::string, std::string>& model_files,
                      const std::string& dir) {
  const auto it = model_files.find("config.json");
  if (it == model_files.end()) return 0;
  const nlohmann::json c = parse_json(it->second, dir + "/config.json");
  for (const nlohmann::json* j :
       {&c, c.is_object() && c.contains("text_config") ? &c["text_config"] : nullptr}) {
    if (!j || !j->is_object()) continue;
    for (const char* k : {"max_position_embeddings", "max_seq_len", "n_positions"})
      if (j->contains(k) && (*j)[k].is_number_integer() && (*j)[k].get<int64_t>() > 0)
        return (*j)[k].get<int64_t>();
  }
  return 0;
}

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

std::vector<QaItem> load_training_data(const TrainConfig& cfg, bool probe_videos,
                                       std::vector<int64_t>* lines) {
  const std::string& path = cfg.data.train;
  try {
    check_regular_file(path, "data.train");
  } catch (const Error& e) {
    LVX_FAIL(e.what(), " (expected the JSONL file of training rows)");
  }
  std::vector<QaItem> items;
  std::string errors;
  int bad = 0;
  std::map<std::string, std::pair<double, double>> spans;  // video → [begin, end] seconds
  // A system message is placed by the family's template, or refused by it (OpenFlamingo and
  // Llama-3.2-Vision have no place for one): rendered once per such row before anything runs.
  std::unique_ptr<models::Tokenizer> tok;
  const models::Family* family = nullptr;
  auto check_system = [&](const QaItem& it, const std::string& where) {
    if (it.system.empty()) return;
    if (!tok) {
      const std::string c = cfg.model.path + "/config.json";
      family = &models::family_of_config(read_json_file(c, "model config"), c);
      tok = std::make_unique<models::Tokenizer>(
          models::Tokenizer::from_file(cfg.model.path + "/tokenizer.json"));
    }
    try {
      training_prompt(*family, *tok, it, 1);
    } catch (const Error& e) {
      LVX_FAIL(where, ": ", e.what());
    }
  };
  // One row at most 1 MiB (a question and its answer), nested at most 64 levels.
  for (QaLine& l : read_qa_rows(path, "data.train", /*need_answer=*/true, uint64_t{1} << 20)) {
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
        auto sp = spans.find(it.video);
        if (sp == spans.end()) {
          const video::VideoDecoder dec(it.video);
          sp = spans
                   .emplace(it.video,
                            std::make_pair(dec.info().begin_seconds, dec.info().end_seconds))
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
      items.push_back(std::move(it));
      if (lines) lines->push_back(l.line);
    } catch (const Error& e) {
      if (bad++ < 5) errors += str("\n  ", e.what());
    }
  }
  LVX_CHECK(bad == 0, "data.train: ", bad, " unusable row(s) in ", path, ":", errors,
            bad > 5 ? "\n  ..." : "");
  LVX_CHECK(!items.empty(), "data.train: ", path, " has no rows");
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

int run_finetune_rank(const FinetuneJob& job) {
  const int64_t base_rss = peak_rss_bytes();  // the process before the model (libraries)
  auto pg = dist::ProcessGroup::from_env();
  const int n = pg->world_size(), r = pg->rank();
  TrainConfig cfg = load_train_config(job.config, job.overrides);
  // Data × sequence parallel: consecutive ranks form the sequence-parallel groups (a node's
  // ranks are consecutive, so a group stays inside a node when sp_size divides its size).
  const int sp = cfg.parallel.sp_size > 0 ? static_cast<int>(cfg.parallel.sp_size) : n;
  LVX_CHECK(n % sp == 0, "parallel.sp_size: ", sp, " does not divide the ", n,
            " ranks (world = data-parallel groups × sp_size)");
  const int dp = n / sp, group = r / sp, sp_rank = r % sp;
  std::shared_ptr<dist::ProcessGroup> sp_pg =
      sp == n ? pg : dist::ProcessGroup::subgroup(pg, group * sp, sp);
  const ShardStage stage = shard_stage_from_string(cfg.parallel.shard, "parallel.shard");
  if (r == 0) std::cout << "effective config:\n" << to_yaml(cfg) << std::flush;
  std::vector<int64_t> lines;
  const std::vector<QaItem> items = load_training_data(cfg, /*probe_videos=*/false, &lines);
  const int64_t samples = static_cast<int64_t>(items.size());

  // A fresh run refuses a directory with checkpoints; latest_checkpoint refuses step folders
  // without a `latest` pointer either way.
  const std::string latest = latest_checkpoint(cfg.checkpoint.dir);
  if (!job.resume)
    LVX_CHECK(latest.empty(), "checkpoint.dir: ", cfg.checkpoint.dir,
              " already holds checkpoints; pass --resume");
  const std::string ckpt = job.resume ? latest : "";
  // The trainer state before anything heavy is loaded; the checkpoint's files (this one
  // included) are verified against its manifest by models::load_model below.
  ResumeState resumed;
  if (!ckpt.empty()) resumed = check_resume_state(cfg, ckpt, samples, job.accept_config_changes);
  if (resumed.grad_accum > 0) cfg.optimizer.grad_accum = resumed.grad_accum;  // the global batch
  if (r == 0) check_metrics_file(cfg, resumed.metrics);
  // A LoRA checkpoint holds the adapter only: the weights come from model.path.
  const std::string model_dir = ckpt.empty() || cfg.lora.r > 0 ? cfg.model.path : ckpt;
  check_model_dir(model_dir, ckpt.empty() ? "model.path" : "checkpoint");
  const at::Device device = choose_device(job.device);
  const at::ScalarType dtype = dtype_of(cfg.model.dtype, "model.dtype");
  // Stage 3 never holds the trainable parameters whole, nor the decoder layers' frozen ones (a
  // LoRA run's base model): they stay unread (meta) here and each rank reads, one tensor at a
  // time, only what its shard needs (the masters; LayerSharding's frozen pieces).
  const bool stage3 = stage == ShardStage::kParameters;
  const bool lora = cfg.lora.r > 0;
  std::shared_ptr<const models::CheckpointIndex> index;  // stage 3: where the deferred ones are
  std::unique_ptr<models::Model> model = models::load_model(
      model_dir, dtype, device,
      stage3 ? models::DeferParameter([&](const models::Model& m, const std::string& name) {
        return m.decoder_layer_of(name) >= 0 ||
               (!lora && models::trains_under(cfg.freeze.policy, m, name));
      })
             : models::DeferParameter(),
      stage3 ? &index : nullptr);
  model = with_lora(std::move(model), cfg, ckpt);  // LoRA (src/runtime/finetune_lora.h)
  const models::Tokenizer tok = models::Tokenizer::from_file(model_dir + "/tokenizer.json");
  const models::Family& family = model->family();
  const std::map<std::string, std::string> model_files = read_model_files(model_dir);
  const video::PreprocessConfig prep = family_preprocess(family, image_size_of(model_dir));
  const int64_t context = model_context(model_files, model_dir);

  // What trains, and the optimizer over it.
  ParamFilter trains = [&](const std::string& name) {
    if (cfg.lora.r > 0) return model->trainable(name);  // LoRA: the adapter only
    return models::trains_under(cfg.freeze.policy, *model, name);
  };
  std::map<std::string, at::Tensor> trainable;
  int64_t trainable_numel = 0, total_numel = 0;
  for (auto& [name, t] : model->parameters()) {
    total_numel += t.numel();
    if (!trains(name)) continue;
    t.requires_grad_(true);
    trainable[name] = t;
    trainable_numel += t.numel();
  }
  LVX_CHECK(!trainable.empty(), "freeze.policy ", cfg.freeze.policy, ": no parameter of this ",
            family.model_type(), " model trains");
  const FlatLayout layout = flat_layout(trainable);
  const bool sharded = stage != ShardStage::kNone;
  AdamW opt(cfg.optimizer, cfg.schedule);
  ShardedAdamW sopt(cfg.optimizer, cfg.schedule, layout, n, r);
  if (stage3 && !lora) {
    // Resuming: the masters come from the checkpoint's optimizer state below.
    std::function<at::Tensor(const std::string&)> read;
    if (ckpt.empty())
      read = [index, device, dtype](const std::string& name) {
        return models::read_tensor(*index, name).to(device, dtype);
      };
    sopt.init(read, device);
  } else if (sharded) {
    sopt.init(trainable);
  } else {
    opt.init(trainable);
  }
  int64_t start = 0, seen0 = 0;
  if (!ckpt.empty()) {
    start = resumed.step;
    seen0 = resumed.samples_seen;
    // The layout the checkpoint recorded (older checkpoints: this run's).
    const nlohmann::json st =
        read_json_file(ckpt + "/trainer_state.json", "trainer state", uint64_t{16} << 20);
    const FlatLayout saved =
        st.contains("optimizer") && st["optimizer"].contains("layout")
            ? FlatLayout::from_json(st["optimizer"]["layout"], ckpt + "/trainer_state.json")
            : layout;
    if (sharded) {
      sopt.load(ckpt, saved, start);
    } else if (fs::exists(ckpt + "/optimizer.safetensors")) {
      opt.load_state(load_safetensors(ckpt + "/optimizer.safetensors").tensors, start,
                     ckpt + "/optimizer.safetensors");
    } else {
      // Sharded state of a run with parallel.shard: gathered whole on every rank.
      LVX_CHECK(saved == layout, ckpt, "/trainer_state.json: the optimizer layout differs from ",
                "this run's trainable parameters (another freeze policy or model?)");
      const auto flat = load_flat_optimizer_state(ckpt, layout, 0, layout.numel());
      std::map<std::string, at::Tensor> per_name;
      for (size_t i = 0; i < layout.names.size(); ++i) {
        const at::Tensor& p = trainable.at(layout.names[i]);
        for (const auto& [k, t] : flat)
          per_name[k + "." + layout.names[i]] =
              t.narrow(0, layout.offsets[i], p.numel()).view(p.sizes());
      }
      opt.load_state(per_name, start, ckpt);
    }
    // The fp32 masters are the truth: the model's copy may be bf16.
    {
      at::AutoGradMode ng(false);
      if (stage3) {
        // Nothing to copy: every gather reads the masters.
      } else if (sharded) {
        const at::Tensor master = sopt.state_tensors().at("master");
        std::vector<int64_t> sizes;
        for (int q = 0; q < n; ++q) {
          const auto [b, e] = dist::shard_range(layout.numel(), n, q);
          sizes.push_back(e - b);
        }
        const at::Tensor full = pg->all_gather(master, sizes);
        for (size_t i = 0; i < layout.names.size(); ++i) {
          at::Tensor p = trainable.at(layout.names[i]).detach();
          p.copy_(full.narrow(0, layout.offsets[i], p.numel()).view(p.sizes()));
        }
      } else {
        for (auto& [name, m] : opt.state_tensors())
          if (name.rfind("master.", 0) == 0) trainable.at(name.substr(7)).detach().copy_(m);
      }
    }
    if (r == 0) std::cout << "resumed from " << ckpt << " at step " << start << "\n";
  }
  // Stages 2 and 3 go layer by layer (src/runtime/layer_sharding.h): each layer's gradients are
  // reduce-scattered once complete; at stage 3 the trainable parameters also become tensors over
  // per-layer buffers that exist only while their layer runs.
  std::unique_ptr<LayerSharding> layered;
  if (stage == ShardStage::kGradients || stage3) {
    LayerSharding::FrozenReader read_frozen;
    if (index)
      read_frozen = [index, device, dtype](const std::string& name) {
        const at::Tensor t = models::read_tensor(*index, name);
        return t.is_floating_point() ? t.to(device, dtype) : t.to(device);
      };
    layered =
        std::make_unique<LayerSharding>(pg, *model, layout, sopt, device, stage3, read_frozen);
    for (auto& [name, t] : trainable) t = model->parameters().at(name);
  }
  if (r == 0) {
    std::cout << family.model_type() << ": " << trainable_numel << " of " << total_numel
              << " parameters train ("
              << (cfg.lora.r > 0 ? str("LoRA r ", cfg.lora.r)
                                 : "freeze.policy " + cfg.freeze.policy)
              << "), " << samples << " samples, " << n << " rank(s) (" << dp
              << " data-parallel × " << sp << " sequence-parallel), parallel.shard "
              << shard_stage_name(stage) << "\n"
              << std::flush;
    fs::create_directories(fs::path(cfg.logging.metrics).parent_path().empty()
                               ? fs::path(".")
                               : fs::path(cfg.logging.metrics).parent_path());
    truncate_metrics(cfg.logging.metrics, start);
  }
  std::ofstream metrics;
  // TensorBoard event files beside the metrics (logging.tensorboard), rank 0's.
  std::unique_ptr<TensorBoardWriter> tensorboard;
  if (r == 0 && !cfg.logging.tensorboard.empty())
    tensorboard = std::make_unique<TensorBoardWriter>(cfg.logging.tensorboard);
  if (r == 0) metrics.open(cfg.logging.metrics, std::ios::app);
  const bool plain = std::getenv("LVX_FINETUNE_BAR") == nullptr;  // the launcher draws a bar

  const auto t_run = std::chrono::steady_clock::now();
  int64_t tokens_run = 0;
  for (int64_t step = start; step < cfg.schedule.steps; ++step) {
    fault_kill(r, step);
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor
        acc;  // summed gradients: flat [Ψ] (none, optimizer) or this rank's shard (gradients)
    // Bytes this rank sent for the training state this step (gradient reduction, parameter
    // all-gather, norm): the counters sharded_state.h's formulas are checked against.
    int64_t state_bytes = 0;
    auto counted = [&](const std::function<void()>& f) {
      const int64_t before = pg->counters_snapshot().total_sent();
      f();
      state_bytes += pg->counters_snapshot().total_sent() - before;
    };
    const int64_t layered_sent0 = layered ? layered->bytes_sent() : 0;
    double loss = 0;
    int64_t tokens = 0, frames = 0;
    for (int64_t a = 0; a < cfg.optimizer.grad_accum; ++a) {
      // Group g takes sample g of each run of dp samples: the order one rank with grad_accum
      // × dp takes them.
      const int64_t k = seen0 + ((step - start) * cfg.optimizer.grad_accum + a) * dp + group;
      const size_t row = static_cast<size_t>(sample_at(cfg.data, samples, k));
      const QaItem& item = items[row];
      const std::string sample = str("step ", step + 1, ", sample '", item.id, "' (",
                                     cfg.data.train, ":", lines[row], ")");
      // This rank's own work for the sample; a failure here is agreed by every rank before the
      // first collective of the forward (a bad video may fail on the rank holding its frames).
      video::FrameBatch fb;
      PromptTokens p;
      std::string local_error;
      try {
        video::SampleSpec spec;
        spec.num_frames = cfg.data.num_frames;
        spec.fps = cfg.data.fps;
        spec.start = item.start;
        spec.end = item.end;
        fb = video::decode_video(item.video, spec, video::ShardSpec{sp_rank, sp}, prep);
        p = training_prompt(family, tok, item, fb.report.sampled_total);  // every turn's answer
        const int64_t len = static_cast<int64_t>(p.ids.size());
        LVX_CHECK(context == 0 || len <= context, "the prompt with its answer is ", len,
                  " tokens (", fb.report.sampled_total, " frames), more than the model's context ",
                  "of ", context, " (config.json); use fewer frames (data.num_frames / data.fps) ",
                  "or a shorter question and answer");
      } catch (const std::exception& e) {
        local_error = e.what();
        if (local_error.empty()) local_error = "unknown error";
      }
      agree_on_errors(*sp_pg, local_error, sample);
      const int64_t len = static_cast<int64_t>(p.ids.size());
      const at::Tensor ids = at::tensor(p.ids, at::kLong).reshape({1, len});
      const at::Tensor labels = at::tensor(p.labels, at::kLong).reshape({1, len});
      std::string plan_text;
      models::Parallel par = plan_layers(
          *model, ids, sp,
          {cfg.parallel.strategies, cfg.parallel.cluster, cfg.model.dtype, /*train=*/true},
          &plan_text);
      par.pg = sp_pg;
      par.recompute_cross_kv = cfg.parallel.recompute;
      par.remat = cfg.parallel.remat;
      if (step == start && a == 0) {
        sp_pg->check_agreement("the fine-tuning step", describe(par));
        if (r == 0 && !plan_text.empty()) std::cout << plan_text << "\n";
      }
      // Frames go to the device once, after preprocessing; ids and labels are host metadata.
      const at::Tensor pixels = fb.frames.defined() ? fb.frames.to(device) : at::Tensor();
      if (layered) {
        if (!acc.defined())
          acc = at::zeros({sopt.end() - sopt.begin()},
                          at::TensorOptions().dtype(at::kFloat).device(device));
        layered->begin_sample(acc);
        par.hooks = layered.get();
      }
      const models::ModelOutputs out =
          model->forward({ids, pixels, /*pixels_local=*/true, {}}, par);
      // The gradients of the sample summed over the world (the sequence-parallel ranks' parts
      // and the other groups' samples): whole (none), summed locally and reduce-scattered once
      // per step (optimizer), or this rank's shard, layer by layer from the engine's hooks
      // (gradients, parameters).
      LocalBackward lb = backward_local(*sp_pg, *model, labels, out,
                                        layered ? std::vector<std::string>{} : layout.names);
      if (layered) layered->end_sample();
      loss += lb.loss.item<double>();
      if (!layered) {
        if (stage == ShardStage::kNone) counted([&] { pg->all_reduce(lb.flat); });
        if (acc.defined())
          acc.add_(lb.flat);
        else
          acc = lb.flat;
      }
      tokens += len;
      frames += fb.report.sampled_total;
    }
    if (stage == ShardStage::kOptimizer) counted([&] { acc = pg->reduce_scatter(acc).clone(); });
    const int64_t per_step = cfg.optimizer.grad_accum * dp;  // samples averaged
    if (per_step > 1) acc.div_(static_cast<double>(per_step));
    if (dp > 1) {
      // The mean of the groups' losses (one contribution per group).
      at::Tensor l = at::full({1}, sp_rank == 0 ? loss : 0.0, at::kDouble);
      pg->all_reduce(l);
      loss = l.item<double>() / dp;
    }
    loss /= static_cast<double>(cfg.optimizer.grad_accum);
    std::map<std::string, at::Tensor> grads;
    if (!sharded)
      for (size_t i = 0; i < layout.names.size(); ++i) {
        const at::Tensor& p = trainable.at(layout.names[i]);
        grads[layout.names[i]] = acc.narrow(0, layout.offsets[i], p.numel()).view(p.sizes());
      }
    // Divergence stops the run before it can reach a checkpoint: the loss and the gradients are
    // already summed across ranks (every rank sees the same values and stops alike), and the
    // parameters are checked after the update, before anything is saved.
    auto diverge = [&](const std::string& what) {
      LVX_FAIL("step ", step + 1, ": training diverged: ", what,
               "; nothing of this step is saved and the last good checkpoint in ",
               cfg.checkpoint.dir, " stays latest (lower optimizer.lr, raise optimizer.eps or ",
               "clip with optimizer.grad_clip, then --resume --accept-config-changes)");
    };
    if (!std::isfinite(loss)) diverge(str("the loss is ", loss));
    double norm = 0;
    try {
      counted([&] {
        norm = sharded ? sopt.step(*pg, acc, layered ? nullptr : &model->parameters())
                       : opt.step(grads, model->parameters());
      });
    } catch (const NonFiniteGradient& e) {
      diverge(e.what());
    }
    acc = at::Tensor();
    // Stage 2: the new values into the whole parameters, a layer's run at a time.
    if (stage == ShardStage::kGradients) layered->refresh_parameters();
    grads.clear();
    if (layered) state_bytes += layered->bytes_sent() - layered_sent0;
    if (const std::string bad = sharded ? sopt.non_finite_master(*pg) : opt.non_finite_master();
        !bad.empty())
      diverge(str("the update made parameter '", bad, "' non-finite (optimizer.lr ",
                  cfg.optimizer.lr, ", optimizer.eps ", cfg.optimizer.eps, ")"));
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // The run's figures are global: every data-parallel group's tokens and frames (counted once,
    // by its first rank), samples over all groups; per-rank figures divide them by the world.
    if (dp > 1) {
      at::Tensor tf = at::tensor({sp_rank == 0 ? tokens : 0, sp_rank == 0 ? frames : 0}, at::kLong);
      pg->all_reduce(tf);
      tokens = tf[0].item<int64_t>();
      frames = tf[1].item<int64_t>();
    }
    tokens_run += tokens;
    // The largest peak RSS of any rank so far, and its process's footprint before the model.
    at::Tensor rss = at::tensor({peak_rss_bytes(), base_rss}, at::kLong);
    pg->all_reduce(rss, dist::ReduceOp::kMax);
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_run).count();
    const int64_t done = step + 1 - start;
    const double eta =
        elapsed / static_cast<double>(done) * static_cast<double>(cfg.schedule.steps - step - 1);
    const double samples_per_second =
        static_cast<double>(done * cfg.optimizer.grad_accum * dp) / elapsed;
    if (r == 0) {
      nlohmann::json m = {
          {"step", step + 1},
          {"loss", loss},
          {"lr", sharded ? sopt.last_lr() : opt.last_lr()},
          {"grad_norm", norm},
          {"tokens", tokens},
          {"frames", frames},
          {"step_seconds", secs},
          {"state_bytes_sent", state_bytes},
          {"peak_rss_bytes", rss[0].item<int64_t>()},
          {"base_rss_bytes", rss[1].item<int64_t>()},
          {"tokens_per_second", tokens_run / elapsed},
          {"samples_per_second", samples_per_second},
          {"tokens_per_second_per_rank", tokens_run / elapsed / n},
          {"samples_per_second_per_rank", samples_per_second / n},
          {"data_parallel_groups", dp},
          {"ranks", n},
          {"eta_seconds", eta},
          {"total_steps", cfg.schedule.steps}};
      metrics << m.dump() << "\n" << std::flush;
      if (tensorboard) tensorboard->metrics(m);
      if (plain && (done % cfg.logging.every == 0 || step + 1 == cfg.schedule.steps)) {
        std::printf(
            "step %lld/%lld  loss %.4f  lr %.3g  grad norm %.3g  %.0f tok/s (%.0f per rank)  "
            "%.3g samples/s  ETA %s\n",
            static_cast<long long>(step + 1), static_cast<long long>(cfg.schedule.steps), loss,
            sharded ? sopt.last_lr() : opt.last_lr(), norm, tokens_run / elapsed,
            tokens_run / elapsed / n, samples_per_second, hms(eta).c_str());
        std::fflush(stdout);
      }
    }
    const bool last = step + 1 == cfg.schedule.steps;
    if (last || (cfg.checkpoint.every > 0 && (step + 1) % cfg.checkpoint.every == 0)) {
      // Parameters are replicated and updated identically, so rank 0 writes them for everyone;
      // with sharded state every rank first writes its optimizer shard into the checkpoint being
      // made. The others wait for the writers as long as the writes take (ranks_write).
      std::vector<std::string> shard_files;
      // Stage 3: the consolidated weights are gathered layer by layer onto rank 0's host.
      std::map<std::string, at::Tensor> whole;
      if (stage3) {
        whole = model->parameters();
        for (auto& [name, t] : layered->consolidated(0)) whole[name] = t;
      }
      if (sharded) {
        if (r == 0) begin_train_checkpoint(cfg.checkpoint.dir, step + 1);
        pg->barrier();
        const std::string tmp = cfg.checkpoint.dir + "/" + checkpoint_name(step + 1) + ".partial";
        ranks_write(*pg, step + 1, true, [&] { save_optimizer_shard(tmp, sopt, n, r, step + 1); });
        for (int q = 0; q < n; ++q) shard_files.push_back(optimizer_shard_name(q, n));
      }
      rank0_writes(*pg, step + 1, [&] {
        const int64_t k = seen0 + (step + 1 - start) * cfg.optimizer.grad_accum * dp;
        nlohmann::json state = {
            {"step", step + 1},
            {"data",
             {{"train", cfg.data.train},
              {"samples", samples},
              {"seed", cfg.data.seed},
              {"shuffle", cfg.data.shuffle},
              {"samples_seen", k},
              {"epoch", k / samples},
              {"position", k % samples}}},
            {"world_size", n},
            {"freeze_policy", cfg.freeze.policy},
            {"optimizer",
             {{"shard", shard_stage_name(stage)}, {"world_size", n}, {"layout", layout.to_json()}}},
            {"config", to_yaml(cfg)}};
        const std::string dir =
            cfg.lora.r > 0  // LoRA: the adapter in PEFT's layout (src/runtime/finetune_lora.h)
                ? save_lora_checkpoint(*model, cfg, step + 1, opt.state_tensors(), state,
                                       shard_files, stage3 ? &whole : nullptr)
                : save_train_checkpoint(
                      cfg.checkpoint.dir, step + 1, model_files,
                      stage3 ? whole : model->parameters(),
                      sharded ? std::map<std::string, at::Tensor>{} : opt.state_tensors(), state,
                      cfg.checkpoint.keep, shard_files);
        if (plain) std::cout << "checkpoint " << dir << "\n" << std::flush;
      });
    }
  }
  pg->barrier();
  return 0;
}

}  // namespace lvx::runtime
