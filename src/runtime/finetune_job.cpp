#include "src/runtime/finetune_job.h"

#include <ATen/core/grad_mode.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "models/model.h"
#include "models/tokenizer.h"
#include "src/common/error.h"
#include "src/common/safetensors.h"
#include "src/dist/process_group.h"
#include "src/runtime/layer_plan.h"
#include "src/runtime/optimizer.h"
#include "src/runtime/train_checkpoint.h"
#include "src/runtime/train_step.h"
#include "video/decoder.h"
#include "video/pipeline.h"

namespace lvx::runtime {

namespace fs = std::filesystem;

namespace {

nlohmann::json read_json(const std::string& path) {
  std::ifstream f(path);
  LVX_CHECK(f.good(), path, ": cannot open");
  try {
    return nlohmann::json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    LVX_FAIL(path, ": not valid JSON: ", e.what());
  }
}

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
  const nlohmann::json c = read_json(where);
  LVX_CHECK(c.contains("vision_config") && c["vision_config"].contains("image_size") &&
                c["vision_config"]["image_size"].is_number_integer(),
            where, ": vision_config.image_size: missing (the frames are resized to it)");
  return c["vision_config"]["image_size"].get<int64_t>();
}

at::ScalarType dtype_of(const std::string& name) {
  return name == "bf16" ? at::kBFloat16 : at::kFloat;
}

// Sample k of the run: epochs of `n` samples, each in its own seeded order.
int64_t sample_at(const TrainConfig::Data& d, int64_t n, int64_t k) {
  const int64_t epoch = k / n, pos = k % n;
  if (!d.shuffle) return pos;
  static std::map<int64_t, at::Tensor> orders;  // per epoch, made once
  auto it = orders.find(epoch);
  if (it == orders.end()) {
    at::Generator g =
        at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(d.seed + epoch));
    it = orders.emplace(epoch, at::randperm(n, g, at::kLong)).first;
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

std::string hms(double s) {
  const int64_t t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(t / 3600),
                static_cast<long long>(t / 60 % 60), static_cast<long long>(t % 60));
  return buf;
}

// Keeps the metrics of steps up to `step` (a resumed run writes the later ones again).
void truncate_metrics(const std::string& path, int64_t step) {
  if (!fs::exists(path)) return;
  std::ifstream in(path);
  std::string kept, line;
  while (std::getline(in, line)) {
    try {
      if (nlohmann::json::parse(line).value("step", int64_t{0}) <= step) kept += line + "\n";
    } catch (const nlohmann::json::exception&) {
      // a line cut short by a kill: dropped
    }
  }
  std::ofstream(path, std::ios::trunc) << kept;
}

}  // namespace

bool trains_under(const std::string& policy, const std::string& family, const std::string& name,
                  bool default_trainable) {
  if (policy == "none") return true;
  if (policy == "vision") return default_trainable;
  auto has = [&](const char* s) { return name.find(s) != std::string::npos; };
  auto ends = [&](const std::string& s) {
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  if (family == "openflamingo")  // OpenFlamingo's own recipe: resampler and gated xattn blocks
    return name.rfind("perceiver.", 0) == 0 || has(".gated_cross_attn_layer.");
  // mPLUG-Owl3 has no resampler: the hyper layers' visual K/V projection and gate, and the
  // vision-to-text projector.
  return has(".v_kv_proj.") || ends(".self_attn.gate") || name.rfind("vision2text_model.", 0) == 0;
}

std::vector<QaItem> load_training_data(const TrainConfig& cfg, bool probe_videos) {
  const std::string& path = cfg.data.train;
  LVX_CHECK(fs::exists(path), "data.train: ", path, ": no such file");
  std::vector<QaItem> items;
  std::string errors;
  int bad = 0;
  std::map<std::string, std::pair<double, double>> spans;  // video → [begin, end] seconds
  for (QaLine& l : read_qa_jsonl(path, /*need_answer=*/true)) {
    const std::string where = str(path, ":", l.line);
    try {
      LVX_CHECK(l.error.empty(), l.error);
      const QaItem& it = l.item;
      LVX_CHECK(fs::exists(it.video), where, ": field 'video': ", it.video, ": no such file");
      if (probe_videos) {
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
          LVX_CHECK(*it.start < end, where, ": field 'start' (", *it.start, " s) is at or after ",
                    "the end of ", it.video, " (", end, " s)");
        if (it.end)
          LVX_CHECK(*it.end <= end + 1e-3 && *it.end > begin, where, ": field 'end' (", *it.end,
                    " s) is outside ", it.video, " (", begin, " to ", end, " s)");
      }
      items.push_back(it);
    } catch (const Error& e) {
      if (bad++ < 5) errors += str("\n  ", e.what());
    }
  }
  LVX_CHECK(bad == 0, "data.train: ", bad, " unusable row(s) in ", path, ":", errors,
            bad > 5 ? "\n  ..." : "");
  LVX_CHECK(!items.empty(), "data.train: ", path, " has no rows");
  return items;
}

TrainConfig validate_finetune_job(const FinetuneJob& job) {
  const TrainConfig cfg = load_train_config(job.config, job.overrides);
  check_model_dir(cfg.model.path, "model.path");
  if (cfg.parallel.strategies != "auto") explicit_strategies(cfg.parallel.strategies, 1);
  if (!cfg.parallel.cluster.empty())
    LVX_CHECK(fs::exists(cfg.parallel.cluster), "parallel.cluster: ", cfg.parallel.cluster,
              ": no such file");
  load_training_data(cfg, /*probe_videos=*/true);
  const std::string latest = latest_checkpoint(cfg.checkpoint.dir);
  if (!job.resume) {
    LVX_CHECK(latest.empty(), "checkpoint.dir: ", cfg.checkpoint.dir, " already holds checkpoints ",
              "(latest: ", fs::path(latest).filename().string(), "); pass --resume to continue ",
              "that run, or choose another checkpoint.dir (nothing is overwritten)");
  } else if (!latest.empty()) {
    verify_checkpoint(latest);
  }
  return cfg;
}

int run_finetune_rank(const FinetuneJob& job) {
  auto pg = dist::ProcessGroup::from_env();
  const int n = pg->world_size(), r = pg->rank();
  const TrainConfig cfg = load_train_config(job.config, job.overrides);
  if (r == 0) std::cout << "effective config:\n" << to_yaml(cfg) << std::flush;
  const std::vector<QaItem> items = load_training_data(cfg, /*probe_videos=*/false);
  const int64_t samples = static_cast<int64_t>(items.size());

  const std::string ckpt = job.resume ? latest_checkpoint(cfg.checkpoint.dir) : "";
  if (!job.resume)
    LVX_CHECK(latest_checkpoint(cfg.checkpoint.dir).empty(), "checkpoint.dir: ", cfg.checkpoint.dir,
              " already holds checkpoints; pass --resume");
  if (!ckpt.empty()) verify_checkpoint(ckpt);
  const std::string model_dir = ckpt.empty() ? cfg.model.path : ckpt;
  check_model_dir(model_dir, ckpt.empty() ? "model.path" : "checkpoint");
  std::unique_ptr<models::Model> model = models::load_model(model_dir, dtype_of(cfg.model.dtype));
  const models::Tokenizer tok = models::Tokenizer::from_file(model_dir + "/tokenizer.json");
  const std::string family = model->family();
  const std::map<std::string, std::string> model_files = read_model_files(model_dir);
  const video::PreprocessConfig prep = family_preprocess(family, image_size_of(model_dir));

  // What trains, and the optimizer over it.
  ParamFilter trains = [&](const std::string& name) {
    return trains_under(cfg.freeze.policy, family, name, model->trainable(name));
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
            family, " model trains");
  AdamW opt(cfg.optimizer, cfg.schedule);
  opt.init(trainable);
  int64_t start = 0;
  if (!ckpt.empty()) {
    const nlohmann::json st = read_json(ckpt + "/trainer_state.json");
    start = st.at("step").get<int64_t>();
    LVX_CHECK(st.at("data").at("samples").get<int64_t>() == samples, ckpt,
              "/trainer_state.json: the run trained on ", st["data"]["samples"], " rows of ",
              st["data"]["train"], "; ", cfg.data.train, " now has ", samples,
              " (the data order would change; resume with the same data)");
    opt.load_state(load_safetensors(ckpt + "/optimizer.safetensors").tensors, start,
                   ckpt + "/optimizer.safetensors");
    // The fp32 masters are the truth: the model's copy may be bf16.
    {
      at::AutoGradMode ng(false);
      for (auto& [name, m] : opt.state_tensors())
        if (name.rfind("master.", 0) == 0) trainable.at(name.substr(7)).detach().copy_(m);
    }
    if (r == 0) std::cout << "resumed from " << ckpt << " at step " << start << "\n";
  }
  if (r == 0) {
    std::cout << family << ": " << trainable_numel << " of " << total_numel
              << " parameters train (freeze.policy " << cfg.freeze.policy << "), " << samples
              << " samples, " << n << " rank(s)\n"
              << std::flush;
    fs::create_directories(fs::path(cfg.logging.metrics).parent_path().empty()
                               ? fs::path(".")
                               : fs::path(cfg.logging.metrics).parent_path());
    truncate_metrics(cfg.logging.metrics, start);
  }
  std::ofstream metrics;
  if (r == 0) metrics.open(cfg.logging.metrics, std::ios::app);
  const bool plain = std::getenv("LVX_FINETUNE_BAR") == nullptr;  // the launcher draws a bar

  const auto t_run = std::chrono::steady_clock::now();
  int64_t tokens_run = 0;
  for (int64_t step = start; step < cfg.schedule.steps; ++step) {
    fault_kill(r, step);
    const auto t0 = std::chrono::steady_clock::now();
    std::map<std::string, at::Tensor> grads;
    double loss = 0;
    int64_t tokens = 0, frames = 0;
    for (int64_t a = 0; a < cfg.optimizer.grad_accum; ++a) {
      const QaItem& item = items[static_cast<size_t>(
          sample_at(cfg.data, samples, step * cfg.optimizer.grad_accum + a))];
      video::SampleSpec spec;
      spec.num_frames = cfg.data.num_frames;
      spec.fps = cfg.data.fps;
      spec.start = item.start;
      spec.end = item.end;
      video::FrameBatch fb;
      try {
        fb = video::decode_video(item.video, spec, video::ShardSpec{r, n}, prep);
      } catch (const Error& e) {
        LVX_FAIL("sample '", item.id, "' (", cfg.data.train, "): ", e.what());
      }
      const std::string target = training_target(item);
      const PromptTokens p =
          build_prompt(family, tok, question_text(item), fb.report.sampled_total, &target);
      const int64_t len = static_cast<int64_t>(p.ids.size());
      const at::Tensor ids = at::tensor(p.ids, at::kLong).reshape({1, len});
      const at::Tensor labels = at::tensor(p.labels, at::kLong).reshape({1, len});
      std::string plan_text;
      models::Parallel par = plan_layers(
          *model, ids, n,
          {cfg.parallel.strategies, cfg.parallel.cluster, cfg.model.dtype, /*train=*/true},
          &plan_text);
      par.pg = pg;
      par.recompute_cross_kv = cfg.parallel.recompute;
      par.remat = cfg.parallel.remat;
      if (step == start && a == 0) {
        pg->check_agreement("the fine-tuning step", describe(par));
        if (r == 0 && !plan_text.empty()) std::cout << plan_text << "\n";
      }
      const models::ModelOutputs out = model->forward({ids, fb.frames, /*pixels_local=*/true}, par);
      std::map<std::string, at::Tensor> res = backward_step(*pg, *model, labels, out, trains);
      for (auto& [name, t] : trainable) t.mutable_grad() = at::Tensor();
      loss += res.at("loss").item<double>();
      res.erase("loss");
      for (auto& [key, g] : res) {
        const std::string name = key.substr(5);  // "grad."
        auto it = grads.find(name);
        if (it == grads.end())
          grads.emplace(name, g);
        else
          it->second.add_(g);
      }
      tokens += len;
      frames += fb.report.sampled_total;
    }
    if (cfg.optimizer.grad_accum > 1)
      for (auto& [name, g] : grads) g.div_(static_cast<double>(cfg.optimizer.grad_accum));
    loss /= static_cast<double>(cfg.optimizer.grad_accum);
    const double norm = opt.step(grads, model->parameters());
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tokens_run += tokens;
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t_run).count();
    const int64_t done = step + 1 - start;
    const double eta =
        elapsed / static_cast<double>(done) * static_cast<double>(cfg.schedule.steps - step - 1);
    if (r == 0) {
      nlohmann::json m = {
          {"step", step + 1},
          {"loss", loss},
          {"lr", opt.last_lr()},
          {"grad_norm", norm},
          {"tokens", tokens},
          {"frames", frames},
          {"step_seconds", secs},
          {"tokens_per_second", tokens_run / elapsed},
          {"samples_per_second", static_cast<double>(done * cfg.optimizer.grad_accum) / elapsed},
          {"eta_seconds", eta},
          {"total_steps", cfg.schedule.steps}};
      metrics << m.dump() << "\n" << std::flush;
      if (plain && (done % cfg.logging.every == 0 || step + 1 == cfg.schedule.steps)) {
        std::printf("step %lld/%lld  loss %.4f  lr %.3g  grad norm %.3g  %.0f tok/s  ETA %s\n",
                    static_cast<long long>(step + 1), static_cast<long long>(cfg.schedule.steps),
                    loss, opt.last_lr(), norm, tokens_run / elapsed, hms(eta).c_str());
        std::fflush(stdout);
      }
    }
    const bool last = step + 1 == cfg.schedule.steps;
    if (last || (cfg.checkpoint.every > 0 && (step + 1) % cfg.checkpoint.every == 0)) {
      // Parameters are replicated and updated identically, so rank 0 writes for everyone.
      if (r == 0) {
        const int64_t k = (step + 1) * cfg.optimizer.grad_accum;
        nlohmann::json state = {{"step", step + 1},
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
                                {"config", to_yaml(cfg)}};
        const std::string dir =
            save_train_checkpoint(cfg.checkpoint.dir, step + 1, model_files, model->parameters(),
                                  opt.state_tensors(), state, cfg.checkpoint.keep);
        if (plain) std::cout << "checkpoint " << dir << "\n" << std::flush;
      }
      pg->barrier();
    }
  }
  pg->barrier();
  return 0;
}

}  // namespace lvx::runtime
