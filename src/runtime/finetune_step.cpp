// One optimizer step of `lvx finetune` on one rank, its metrics line and its checkpoint
// (finetune_rank.h).
#include <ATen/core/grad_mode.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <future>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <tuple>

#include "src/common/error.h"
#include "src/dist/process_group.h"
#include "src/runtime/finetune_lora.h"
#include "src/runtime/finetune_rank.h"
#include "src/runtime/layer_plan.h"
#include "src/runtime/train_checkpoint.h"
#include "src/runtime/train_faults.h"
#include "src/runtime/train_step.h"
#include "src/runtime/video_qa.h"
#include "video/pipeline.h"

namespace lvx::runtime {

namespace {

// Sample k of the run: epochs of `n` samples, each in its own seeded order. Called from the
// prefetch's workers too.
int64_t sample_at(const TrainConfig::Data& d, int64_t n, int64_t k) {
  const int64_t epoch = k / n, pos = k % n;
  if (!d.shuffle) return pos;
  // Per (epoch, row count, seed), made once: an order is a function of all three.
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
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

double since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

std::string hms(double s) {
  const int64_t t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(t / 3600),
                static_cast<long long>(t / 60 % 60), static_cast<long long>(t % 60));
  return buf;
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

// Micro-batch a of `step`: this group's sample, forward and backward. The gradients of the
// sample summed over the world (the sequence-parallel ranks' parts and the other groups'
// samples) go into `acc`: whole (none), summed locally and reduce-scattered once per step
// (optimizer), or this rank's shard, layer by layer from the engine's hooks (gradients,
// parameters).
double run_sample(RankRun& run, int64_t step, int64_t a, at::Tensor& acc, StepResult& res,
                  const std::function<void(const std::function<void()>&)>& counted) {
  const TrainConfig& cfg = run.cfg;
  // Group g takes sample g of each run of dp samples: the order one rank with grad_accum × dp
  // takes them.
  const int64_t k =
      run.seen0 + ((step - run.start) * cfg.optimizer.grad_accum + a) * run.dp + run.group;
  const size_t row = static_cast<size_t>(sample_at(cfg.data, run.samples, k));
  const QaItem& item = run.items[row];
  const auto t_in = std::chrono::steady_clock::now();
  LocalSample local = run.prefetch ? run.prefetch->take(k) : prepare_sample(run, item);
  res.input_wait_s += since(t_in);
  res.input_s += local.seconds;
  const SampleInputs in = agreed_inputs(run, std::move(local),
                                        str("step ", step + 1, ", sample '", item.id, "' (",
                                            cfg.data.train, ":", run.lines[row], ")"));
  std::string plan_text;
  models::Parallel par = plan_layers(
      *run.model, in.ids, run.sp,
      {cfg.parallel.strategies, cfg.parallel.cluster, cfg.model.dtype, /*train=*/true}, &plan_text);
  par.pg = run.sp_pg;
  par.recompute_cross_kv = cfg.parallel.recompute;
  par.remat = cfg.parallel.remat;
  if (step == run.start && a == 0) {
    run.sp_pg->check_agreement("the fine-tuning step", describe(par));
    if (run.r == 0 && !plan_text.empty()) std::cout << plan_text << "\n";
  }
  if (run.layered) {
    if (!acc.defined())
      acc = at::zeros({run.sopt->end() - run.sopt->begin()},
                      at::TensorOptions().dtype(at::kFloat).device(run.device));
    run.layered->begin_sample(acc);
    par.hooks = run.layered.get();
  }
  const models::ModelOutputs out =
      run.model->forward({in.ids, in.pixels, /*pixels_local=*/true, {}}, par);
  LocalBackward lb = backward_local(*run.sp_pg, *run.model, in.labels, out,
                                    run.layered ? std::vector<std::string>{} : run.layout.names);
  if (run.layered) run.layered->end_sample();
  if (!run.layered) {
    if (run.stage == ShardStage::kNone) counted([&] { run.pg->all_reduce(lb.flat); });
    if (acc.defined())
      acc.add_(lb.flat);
    else
      acc = lb.flat;
  }
  res.tokens += in.tokens;
  res.frames += in.frames;
  planner::SampleShape shape = run.flops_shape;
  shape.frames = in.frames;
  shape.text_tokens = in.tokens;
  res.model_flops += planner::train_flops(run.flops_model, shape).training;
  return lb.loss.item<double>();
}

// Divergence stops the run before it can reach a checkpoint: the loss and the gradients are
// already summed across ranks (every rank sees the same values and stops alike), and the
// parameters are checked after the update, before anything is saved.
[[noreturn]] void diverged(const RankRun& run, int64_t step, const std::string& what) {
  LVX_FAIL("step ", step + 1, ": training diverged: ", what,
           "; nothing of this step is saved and the last good checkpoint in ",
           run.cfg.checkpoint.dir, " stays latest (lower optimizer.lr, raise optimizer.eps or ",
           "clip with optimizer.grad_clip, then --resume --accept-config-changes)");
}

// The update from the step's summed gradients `acc`; returns the gradient norm.
double apply_update(RankRun& run, int64_t step, at::Tensor& acc,
                    const std::function<void(const std::function<void()>&)>& counted) {
  std::map<std::string, at::Tensor> grads;
  if (!run.sharded)
    for (size_t i = 0; i < run.layout.names.size(); ++i) {
      const at::Tensor& p = run.trainable.at(run.layout.names[i]);
      grads[run.layout.names[i]] = acc.narrow(0, run.layout.offsets[i], p.numel()).view(p.sizes());
    }
  double norm = 0;
  try {
    counted([&] {
      norm = run.sharded
                 ? run.sopt->step(*run.pg, acc, run.layered ? nullptr : &run.model->parameters())
                 : run.opt->step(grads, run.model->parameters());
    });
  } catch (const NonFiniteGradient& e) {
    diverged(run, step, e.what());
  }
  acc = at::Tensor();
  // Stage 2: the new values into the whole parameters, a layer's run at a time.
  if (run.stage == ShardStage::kGradients) run.layered->refresh_parameters();
  const TrainConfig& cfg = run.cfg;
  if (const std::string bad =
          run.sharded ? run.sopt->non_finite_master(*run.pg) : run.opt->non_finite_master();
      !bad.empty())
    diverged(run, step,
             str("the update made parameter '", bad, "' non-finite (optimizer.lr ",
                 cfg.optimizer.lr, ", optimizer.eps ", cfg.optimizer.eps, ")"));
  return norm;
}

// The mean of the data-parallel groups' losses (one contribution per group), and the groups'
// tokens and frames (each counted once, by the group's first rank).
void sum_over_groups(const RankRun& run, StepResult& s) {
  if (run.dp <= 1) return;
  // One rank of each group counts its group's loss and model FLOPs.
  const bool counts = run.sp_rank == 0;
  at::Tensor l = at::tensor({counts ? s.loss : 0.0, counts ? s.model_flops : 0.0}, at::kDouble);
  run.pg->all_reduce(l);
  s.loss = l[0].item<double>() / run.dp;
  s.model_flops = l[1].item<double>();
  at::Tensor tf = at::tensor(
      {run.sp_rank == 0 ? s.tokens : int64_t{0}, run.sp_rank == 0 ? s.frames : int64_t{0}},
      at::kLong);
  run.pg->all_reduce(tf);
  s.tokens = tf[0].item<int64_t>();
  s.frames = tf[1].item<int64_t>();
}

double last_lr(const RankRun& run) {
  return run.sharded ? run.sopt->last_lr() : run.opt->last_lr();
}

// What --resume reads back (trainer_state.json).
nlohmann::json trainer_state(const RankRun& run, int64_t step) {
  const TrainConfig& cfg = run.cfg;
  const int64_t k = run.seen0 + (step + 1 - run.start) * cfg.optimizer.grad_accum * run.dp;
  return {{"step", step + 1},
          {"data",
           {{"train", cfg.data.train},
            {"samples", run.samples},
            {"seed", cfg.data.seed},
            {"shuffle", cfg.data.shuffle},
            {"samples_seen", k},
            {"epoch", k / run.samples},
            {"position", k % run.samples}}},
          {"world_size", run.n},
          {"freeze_policy", cfg.freeze.policy},
          {"optimizer",
           {{"shard", shard_stage_name(run.stage)},
            {"world_size", run.n},
            {"layout", run.layout.to_json()}}},
          {"config", to_yaml(cfg)}};
}

}  // namespace

int64_t peak_rss_bytes() {
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  return static_cast<int64_t>(ru.ru_maxrss) * 1024;
}

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

void rank0_writes(dist::ProcessGroup& pg, int64_t step, const std::function<void()>& write) {
  ranks_write(pg, step, pg.rank() == 0, write);
}

LocalSample prepare_sample(const RankRun& run, const QaItem& item) {
  // This rank's own work for the sample (no collective: the prefetch's workers run it too); a
  // failure here is agreed by every rank before the first collective of the forward (a bad video
  // may fail on the rank holding its frames).
  const auto t0 = std::chrono::steady_clock::now();
  LocalSample out;
  video::FrameBatch& fb = out.frames;
  PromptTokens& p = out.prompt;
  try {
    video::SampleSpec spec;
    spec.num_frames = run.cfg.data.num_frames;
    spec.fps = run.cfg.data.fps;
    spec.start = item.start;
    spec.end = item.end;
    fb = video::decode_video(item.video, spec, video::ShardSpec{run.sp_rank, run.sp}, run.prep);
    p = training_prompt(run.model->family(), *run.tok, item, fb.report.sampled_total);
    const int64_t len = static_cast<int64_t>(p.ids.size());
    LVX_CHECK(run.context == 0 || len <= run.context, "the prompt with its answer is ", len,
              " tokens (", fb.report.sampled_total, " frames), more than the model's context ",
              "of ", run.context, " (config.json); use fewer frames (data.num_frames / ",
              "data.fps) or a shorter question and answer");
  } catch (const std::exception& e) {
    out.error = e.what();
    if (out.error.empty()) out.error = "unknown error";
  }
  out.seconds = since(t0);
  return out;
}

SampleInputs agreed_inputs(const RankRun& run, LocalSample local, const std::string& what) {
  agree_on_errors(*run.sp_pg, local.error, what);
  const video::FrameBatch& fb = local.frames;
  const PromptTokens& p = local.prompt;
  SampleInputs in;
  const int64_t len = static_cast<int64_t>(p.ids.size());
  in.ids = at::tensor(p.ids, at::kLong).reshape({1, len});
  in.labels = at::tensor(p.labels, at::kLong).reshape({1, len});
  // Frames go to the device once, after preprocessing; ids and labels are host metadata.
  in.pixels = fb.frames.defined() ? fb.frames.to(run.device) : at::Tensor();
  in.tokens = len;
  in.frames = fb.report.sampled_total;
  return in;
}

SampleInputs sample_inputs(const RankRun& run, const QaItem& item, const std::string& what) {
  return agreed_inputs(run, prepare_sample(run, item), what);
}

void start_prefetch(RankRun& run) {
  const TrainConfig::Data& d = run.cfg.data;
  if (d.prefetch <= 0) return;
  // This group's first sample of the run (or of the resumed part), then one per group.
  const int64_t first = run.seen0 + run.group;
  const RankRun* r = &run;
  run.prefetch = std::make_unique<SamplePrefetch>(
      [r](int64_t k) {
        const size_t row = static_cast<size_t>(sample_at(r->cfg.data, r->samples, k));
        return prepare_sample(*r, r->items[row]);
      },
      first, run.dp, static_cast<int>(d.prefetch), static_cast<int>(d.workers));
}

StepResult train_step(RankRun& run, int64_t step) {
  if (TrainFaults* f = train_faults()) f->step_begins(run.r, step);  // tests only
  const TrainConfig& cfg = run.cfg;
  const auto t0 = std::chrono::steady_clock::now();
  StepResult res;
  // Bytes this rank sent for the training state this step (gradient reduction, parameter
  // all-gather, norm): the counters sharded_state.h's formulas are checked against.
  auto counted = [&](const std::function<void()>& f) {
    const int64_t before = run.pg->counters_snapshot().total_sent();
    f();
    res.state_bytes += run.pg->counters_snapshot().total_sent() - before;
  };
  const int64_t layered_sent0 = run.layered ? run.layered->bytes_sent() : 0;
  at::Tensor acc;  // summed gradients: flat [Ψ] (none, optimizer) or this rank's shard
  for (int64_t a = 0; a < cfg.optimizer.grad_accum; ++a)
    res.loss += run_sample(run, step, a, acc, res, counted);
  if (run.stage == ShardStage::kOptimizer)
    counted([&] { acc = run.pg->reduce_scatter(acc).clone(); });
  const int64_t per_step = cfg.optimizer.grad_accum * run.dp;  // samples averaged
  if (per_step > 1) acc.div_(static_cast<double>(per_step));
  sum_over_groups(run, res);
  res.loss /= static_cast<double>(cfg.optimizer.grad_accum);
  if (!std::isfinite(res.loss)) diverged(run, step, str("the loss is ", res.loss));
  res.norm = apply_update(run, step, acc, counted);
  if (run.layered) res.state_bytes += run.layered->bytes_sent() - layered_sent0;
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

void log_step(RankRun& run, int64_t step, const StepResult& s) {
  const TrainConfig& cfg = run.cfg;
  run.tokens_run += s.tokens;
  // The largest peak RSS of any rank so far, and its process's footprint before the model.
  at::Tensor rss = at::tensor({peak_rss_bytes(), run.base_rss}, at::kLong);
  run.pg->all_reduce(rss, dist::ReduceOp::kMax);
  if (run.r != 0) return;
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - run.t_run).count();
  const int64_t done = step + 1 - run.start;
  const double eta =
      elapsed / static_cast<double>(done) * static_cast<double>(cfg.schedule.steps - step - 1);
  // The run's figures are global: every data-parallel group's tokens, frames and samples;
  // per-rank figures divide them by the world.
  const double samples_per_second =
      static_cast<double>(done * cfg.optimizer.grad_accum * run.dp) / elapsed;
  const nlohmann::json m = {
      {"step", step + 1},
      {"loss", s.loss},
      {"lr", last_lr(run)},
      {"grad_norm", s.norm},
      {"tokens", s.tokens},
      {"frames", s.frames},
      {"step_seconds", s.seconds},
      {"model_flops", s.model_flops},
      {"flops_per_second", s.model_flops / s.seconds},
      {"mfu", run.peak_flops > 0 ? nlohmann::json(s.model_flops / s.seconds / run.peak_flops)
                                 : nlohmann::json()},
      // The planner's prediction: the model FLOPs at the peak, plus its collectives' seconds.
      {"predicted_step_seconds",
       run.peak_flops > 0 && run.step_traffic_s >= 0
           ? nlohmann::json(s.model_flops / run.peak_flops + run.step_traffic_s)
           : nlohmann::json()},
      {"predicted_traffic_seconds",
       run.step_traffic_s >= 0 ? nlohmann::json(run.step_traffic_s) : nlohmann::json()},
      {"input_seconds", s.input_s},
      {"input_wait_seconds", s.input_wait_s},
      {"state_bytes_sent", s.state_bytes},
      {"peak_rss_bytes", rss[0].item<int64_t>()},
      {"base_rss_bytes", rss[1].item<int64_t>()},
      {"tokens_per_second", run.tokens_run / elapsed},
      {"samples_per_second", samples_per_second},
      {"tokens_per_second_per_rank", run.tokens_run / elapsed / run.n},
      {"samples_per_second_per_rank", samples_per_second / run.n},
      {"data_parallel_groups", run.dp},
      {"ranks", run.n},
      {"eta_seconds", eta},
      {"total_steps", cfg.schedule.steps}};
  run.metrics << m.dump() << "\n" << std::flush;
  if (run.tensorboard) run.tensorboard->metrics(m);
  if (run.plain && (done % cfg.logging.every == 0 || step + 1 == cfg.schedule.steps)) {
    std::printf(
        "step %lld/%lld  loss %.4f  lr %.3g  grad norm %.3g  %.0f tok/s (%.0f per rank)  "
        "%.3g samples/s  ETA %s\n",
        static_cast<long long>(step + 1), static_cast<long long>(cfg.schedule.steps), s.loss,
        last_lr(run), s.norm, run.tokens_run / elapsed, run.tokens_run / elapsed / run.n,
        samples_per_second, hms(eta).c_str());
    std::fflush(stdout);
  }
}

bool checkpoint_due(const RankRun& run, int64_t step) {
  const auto& c = run.cfg;
  return step + 1 == c.schedule.steps ||
         (c.checkpoint.every > 0 && (step + 1) % c.checkpoint.every == 0);
}

void save_checkpoint(RankRun& run, int64_t step) {
  const TrainConfig& cfg = run.cfg;
  dist::ProcessGroup& pg = *run.pg;
  // Parameters are replicated and updated identically, so rank 0 writes them for everyone; with
  // sharded state every rank first writes its optimizer shard into the checkpoint being made.
  // The others wait for the writers as long as the writes take (ranks_write).
  std::vector<std::string> shard_files;
  // Stage 3: the consolidated weights are gathered layer by layer onto rank 0's host.
  std::map<std::string, at::Tensor> whole;
  if (run.stage3) {
    whole = run.model->parameters();
    for (auto& [name, t] : run.layered->consolidated(0)) whole[name] = t;
  }
  if (run.sharded) {
    if (run.r == 0) begin_train_checkpoint(cfg.checkpoint.dir, step + 1);
    pg.barrier();
    const std::string tmp = cfg.checkpoint.dir + "/" + checkpoint_name(step + 1) + ".partial";
    ranks_write(pg, step + 1, true,
                [&] { save_optimizer_shard(tmp, *run.sopt, run.n, run.r, step + 1); });
    for (int q = 0; q < run.n; ++q) shard_files.push_back(optimizer_shard_name(q, run.n));
  }
  rank0_writes(pg, step + 1, [&] {
    const nlohmann::json state = trainer_state(run, step);
    const std::map<std::string, at::Tensor> none;
    const std::string dir =
        run.lora  // LoRA: the adapter in PEFT's layout (src/runtime/finetune_lora.h)
            ? save_lora_checkpoint(*run.model, cfg, step + 1, run.opt->state_tensors(), state,
                                   shard_files, run.stage3 ? &whole : nullptr)
            : save_train_checkpoint(cfg.checkpoint.dir, step + 1, run.model_files,
                                    run.stage3 ? whole : run.model->parameters(),
                                    run.sharded ? none : run.opt->state_tensors(), state,
                                    cfg.checkpoint.keep, shard_files);
    if (run.plain) std::cout << "checkpoint " << dir << "\n" << std::flush;
  });
}

}  // namespace lvx::runtime
