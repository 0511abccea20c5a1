// `lvx finetune` on one rank: run_finetune_rank as its named steps, and the steps that set the
// run up (finetune_rank.h).
#include "src/runtime/finetune_rank.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"
#include "src/dist/process_group.h"
#include "src/planner/cluster_config.h"
#include "src/planner/train_traffic.h"
#include "src/runtime/device.h"
#include "src/runtime/finetune_eval.h"
#include "src/runtime/finetune_lora.h"
#include "src/runtime/model_description.h"
#include "src/runtime/train_checkpoint.h"
#include "src/runtime/video_qa.h"

namespace lvx::runtime {

namespace fs = std::filesystem;

namespace {

int64_t image_size_of(const std::string& dir) {
  const std::string where = dir + "/config.json";
  const nlohmann::json c = read_json_file(where, "model config");
  LVX_CHECK(c.is_object() && c.contains("vision_config") && c["vision_config"].is_object() &&
                c["vision_config"].contains("image_size") &&
                c["vision_config"]["image_size"].is_number_integer(),
            where, ": vision_config.image_size: missing (the frames are resized to it)");
  return c["vision_config"]["image_size"].get<int64_t>();
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

// The fp32 masters are the truth after a resume: the model's copy may be bf16. Stage 3 has
// nothing to copy (every gather reads the masters).
void masters_into_model(RankRun& run) {
  at::AutoGradMode ng(false);
  if (run.stage3) return;
  if (!run.sharded) {
    for (auto& [name, m] : run.opt->state_tensors())
      if (name.rfind("master.", 0) == 0) run.trainable.at(name.substr(7)).detach().copy_(m);
    return;
  }
  const at::Tensor master = run.sopt->state_tensors().at("master");
  std::vector<int64_t> sizes;
  for (int q = 0; q < run.n; ++q) {
    const auto [b, e] = dist::shard_range(run.layout.numel(), run.n, q);
    sizes.push_back(e - b);
  }
  const at::Tensor full = run.pg->all_gather(master, sizes);
  for (size_t i = 0; i < run.layout.names.size(); ++i) {
    at::Tensor p = run.trainable.at(run.layout.names[i]).detach();
    p.copy_(full.narrow(0, run.layout.offsets[i], p.numel()).view(p.sizes()));
  }
}

// Sharded optimizer state of a run with parallel.shard, resumed without: gathered whole.
void load_gathered_state(RankRun& run, const FlatLayout& saved) {
  LVX_CHECK(saved == run.layout, run.ckpt, "/trainer_state.json: the optimizer layout differs ",
            "from this run's trainable parameters (another freeze policy or model?)");
  const auto flat = load_flat_optimizer_state(run.ckpt, run.layout, 0, run.layout.numel());
  std::map<std::string, at::Tensor> per_name;
  for (size_t i = 0; i < run.layout.names.size(); ++i) {
    const at::Tensor& p = run.trainable.at(run.layout.names[i]);
    for (const auto& [k, t] : flat)
      per_name[k + "." + run.layout.names[i]] =
          t.narrow(0, run.layout.offsets[i], p.numel()).view(p.sizes());
  }
  run.opt->load_state(per_name, run.start, run.ckpt);
}

}  // namespace

RankRun open_run(const FinetuneJob& job) {
  RankRun run;
  run.base_rss = peak_rss_bytes();
  run.pg = dist::ProcessGroup::from_env();
  run.n = run.pg->world_size();
  run.r = run.pg->rank();
  run.cfg = load_train_config(job.config, job.overrides);
  const TrainConfig& cfg = run.cfg;
  run.sp = cfg.parallel.sp_size > 0 ? static_cast<int>(cfg.parallel.sp_size) : run.n;
  LVX_CHECK(run.n % run.sp == 0, "parallel.sp_size: ", run.sp, " does not divide the ", run.n,
            " ranks (world = data-parallel groups × sp_size)");
  run.dp = run.n / run.sp;
  run.group = run.r / run.sp;
  run.sp_rank = run.r % run.sp;
  run.sp_pg =
      run.sp == run.n ? run.pg : dist::ProcessGroup::subgroup(run.pg, run.group * run.sp, run.sp);
  run.stage = shard_stage_from_string(cfg.parallel.shard, "parallel.shard");
  run.stage3 = run.stage == ShardStage::kParameters;
  run.sharded = run.stage != ShardStage::kNone;
  run.lora = cfg.lora.r > 0;
  if (run.r == 0) std::cout << "effective config:\n" << to_yaml(cfg) << std::flush;
  run.items = load_training_data(cfg, /*probe_videos=*/false, &run.lines);
  run.samples = static_cast<int64_t>(run.items.size());
  // A fresh run refuses a directory with checkpoints; latest_checkpoint refuses step folders
  // without a `latest` pointer either way.
  const std::string latest = latest_checkpoint(cfg.checkpoint.dir);
  if (!job.resume)
    LVX_CHECK(latest.empty(), "checkpoint.dir: ", cfg.checkpoint.dir,
              " already holds checkpoints; pass --resume");
  run.ckpt = job.resume ? latest : "";
  // The trainer state before anything heavy is loaded; the checkpoint's files (this one
  // included) are verified against its manifest by models::load_model.
  if (!run.ckpt.empty())
    run.resumed = check_resume_state(cfg, run.ckpt, run.samples, job.accept_config_changes);
  if (run.resumed.grad_accum > 0) run.cfg.optimizer.grad_accum = run.resumed.grad_accum;
  if (run.r == 0) check_metrics_file(cfg, run.resumed.metrics);
  run.start = run.resumed.step;
  run.seen0 = run.resumed.samples_seen;
  return run;
}

void load_run_model(RankRun& run, const FinetuneJob& job) {
  const TrainConfig& cfg = run.cfg;
  // A LoRA checkpoint holds the adapter only: the weights come from model.path.
  run.model_dir = run.ckpt.empty() || run.lora ? cfg.model.path : run.ckpt;
  check_model_dir(run.model_dir, run.ckpt.empty() ? "model.path" : "checkpoint");
  run.device = choose_device(job.device);
  run.dtype = dtype_of(cfg.model.dtype, "model.dtype");
  // Stage 3 never holds the trainable parameters whole, nor the decoder layers' frozen ones (a
  // LoRA run's base model): they stay unread (meta) here and each rank reads, one tensor at a
  // time, only what its shard needs (the masters; LayerSharding's frozen pieces).
  const bool lora = run.lora;
  run.model = models::load_model(
      run.model_dir, run.dtype, run.device,
      run.stage3 ? models::DeferParameter([&](const models::Model& m, const std::string& name) {
        return m.decoder_layer_of(name) >= 0 ||
               (!lora && models::trains_under(cfg.freeze.policy, m, name));
      })
                 : models::DeferParameter(),
      run.stage3 ? &run.index : nullptr);
  run.model = with_lora(std::move(run.model), cfg, run.ckpt);  // (src/runtime/finetune_lora.h)
  run.tok = std::make_unique<models::Tokenizer>(
      models::Tokenizer::from_file(run.model_dir + "/tokenizer.json"));
  run.model_files = read_model_files(run.model_dir);
  run.prep = family_preprocess(run.model->family(), image_size_of(run.model_dir));
  run.context = model_context(run.model_files, run.model_dir);
}

void choose_trainable(RankRun& run) {
  const TrainConfig& cfg = run.cfg;
  models::Model& model = *run.model;
  for (auto& [name, t] : model.parameters()) {
    run.total_numel += t.numel();
    const bool trains =
        run.lora ? model.trainable(name) : models::trains_under(cfg.freeze.policy, model, name);
    if (!trains) continue;
    t.requires_grad_(true);
    run.trainable[name] = t;
    run.trainable_numel += t.numel();
  }
  LVX_CHECK(!run.trainable.empty(), "freeze.policy ", cfg.freeze.policy, ": no parameter of this ",
            model.family().model_type(), " model trains");
  run.layout = flat_layout(run.trainable);
}

void init_optimizer(RankRun& run) {
  const TrainConfig& cfg = run.cfg;
  run.opt = std::make_unique<AdamW>(cfg.optimizer, cfg.schedule);
  run.sopt = std::make_unique<ShardedAdamW>(cfg.optimizer, cfg.schedule, run.layout, run.n, run.r);
  if (run.stage3 && !run.lora) {
    // Resuming: the masters come from the checkpoint's optimizer state (restore_state).
    std::function<at::Tensor(const std::string&)> read;
    if (run.ckpt.empty())
      read = [index = run.index, device = run.device, dtype = run.dtype](const std::string& name) {
        return models::read_tensor(*index, name).to(device, dtype);
      };
    run.sopt->init(read, run.device);
  } else if (run.sharded) {
    run.sopt->init(run.trainable);
  } else {
    run.opt->init(run.trainable);
  }
}

void restore_state(RankRun& run) {
  if (run.ckpt.empty()) return;
  // The layout the checkpoint recorded (older checkpoints: this run's).
  const nlohmann::json st =
      read_json_file(run.ckpt + "/trainer_state.json", "trainer state", uint64_t{16} << 20);
  const FlatLayout saved =
      st.contains("optimizer") && st["optimizer"].contains("layout")
          ? FlatLayout::from_json(st["optimizer"]["layout"], run.ckpt + "/trainer_state.json")
          : run.layout;
  if (run.sharded) {
    run.sopt->load(run.ckpt, saved, run.start);
  } else if (fs::exists(run.ckpt + "/optimizer.safetensors")) {
    run.opt->load_state(load_safetensors(run.ckpt + "/optimizer.safetensors").tensors, run.start,
                        run.ckpt + "/optimizer.safetensors");
  } else {
    load_gathered_state(run, saved);
  }
  masters_into_model(run);
  if (run.r == 0) std::cout << "resumed from " << run.ckpt << " at step " << run.start << "\n";
}

void shard_layers(RankRun& run) {
  // Stages 2 and 3 go layer by layer (src/runtime/layer_sharding.h): each layer's gradients are
  // reduce-scattered once complete; at stage 3 the trainable parameters also become tensors over
  // per-layer buffers that exist only while their layer runs.
  if (run.stage != ShardStage::kGradients && !run.stage3) return;
  LayerSharding::FrozenReader read_frozen;
  if (run.index)
    read_frozen = [index = run.index, device = run.device,
                   dtype = run.dtype](const std::string& name) {
      const at::Tensor t = models::read_tensor(*index, name);
      return t.is_floating_point() ? t.to(device, dtype) : t.to(device);
    };
  run.layered = std::make_unique<LayerSharding>(run.pg, *run.model, run.layout, *run.sopt,
                                                run.device, run.stage3, read_frozen);
  for (auto& [name, t] : run.trainable) t = run.model->parameters().at(name);
}

void open_logs(RankRun& run) {
  const TrainConfig& cfg = run.cfg;
  run.plain = std::getenv("LVX_FINETUNE_BAR") == nullptr;
  run.t_run = std::chrono::steady_clock::now();
  if (run.r != 0) return;
  std::cout << run.model->family().model_type() << ": " << run.trainable_numel << " of "
            << run.total_numel << " parameters train ("
            << (run.lora ? str("LoRA r ", cfg.lora.r) : "freeze.policy " + cfg.freeze.policy)
            << "), " << run.samples << " samples, " << run.n << " rank(s) (" << run.dp
            << " data-parallel × " << run.sp << " sequence-parallel), parallel.shard "
            << shard_stage_name(run.stage) << "\n"
            << std::flush;
  const fs::path parent = fs::path(cfg.logging.metrics).parent_path();
  fs::create_directories(parent.empty() ? fs::path(".") : parent);
  truncate_metrics(cfg.logging.metrics, run.start);
  // TensorBoard event files beside the metrics (logging.tensorboard), rank 0's.
  if (!cfg.logging.tensorboard.empty())
    run.tensorboard = std::make_unique<TensorBoardWriter>(cfg.logging.tensorboard);
  run.metrics.open(cfg.logging.metrics, std::ios::app);
}

// The planner's seconds of one optimizer step's collectives for this run's stage, world,
// adapters and accumulation on cluster `c` (what `lvx plan --train` prints as the step's traffic).
static double step_traffic_seconds(const RankRun& run, const planner::ParamCounts& counts,
                                   const planner::ClusterConfig& c) {
  const TrainConfig& cfg = run.cfg;
  planner::TrainMemoryOptions mo;
  mo.shard = cfg.parallel.shard;
  mo.ranks = run.n;
  mo.sp_size = run.sp;
  mo.lora_r = run.lora ? cfg.lora.r : 0;
  mo.recompute = cfg.parallel.recompute;
  mo.remat = cfg.parallel.remat;
  mo.grad_accum = cfg.optimizer.grad_accum;
  mo.elem_bytes = dtype_bytes(cfg.model.dtype, "model.dtype");
  return planner::train_traffic(run.flops_model, counts, mo, c).seconds;
}

void price_flops(RankRun& run) {
  const TrainConfig& cfg = run.cfg;
  run.flops_model = run.model->planner_model();
  const planner::ParamCounts counts =
      count_parameters(run.model_dir, run.flops_model, cfg.freeze.policy);
  planner::SampleShape& s = run.flops_shape;
  s.tokens_per_frame = run.flops_model.visual_tokens_per_frame;
  s.lm_parameters = counts.layers;
  s.vocab = counts.vocab;
  s.hidden = run.flops_model.layers.empty() ? 0 : run.flops_model.layers.front().hidden_size;
  s.vision_trains = !run.lora && cfg.freeze.policy == "none";
  s.lora = run.lora;
  std::string source =
      "no parallel.cluster to read the devices' peak from (lvx calibrate writes "
      "one for this machine): no MFU";
  if (!cfg.parallel.cluster.empty()) {
    const planner::ClusterConfig c = planner::load_cluster_config(cfg.parallel.cluster);
    if (!c.gemm_flops.count(cfg.model.dtype)) {
      if (run.r == 0)
        std::cout << "model FLOPs per step logged; no MFU: " << cfg.parallel.cluster
                  << " has no gemm_tflops." << cfg.model.dtype << "\n";
      return;
    }
    // A shared host (a CPU: the ranks split its cores) has the rate of the ranks it was calibrated
    // with whatever the run's ranks (planner/question_price.h counts it the same way).
    const double devices =
        c.memory.shared ? double(std::max<int64_t>(1, c.gpus_per_node)) : double(run.n);
    run.peak_flops = c.gemm_for(cfg.model.dtype) * devices;
    run.step_traffic_s = step_traffic_seconds(run, counts, c);
    source = str("against ", run.peak_flops / 1e12, " TFLOP/s (", cfg.parallel.cluster, ": ",
                 cfg.model.dtype, " GEMM × ", devices,
                 " device(s)); predicted step time: the FLOPs at that peak + ", run.step_traffic_s,
                 " s of collectives");
  }
  if (run.r == 0) std::cout << "model FLOPs per step logged; MFU " << source << "\n";
}

int run_finetune_rank(const FinetuneJob& job) {
  RankRun run = open_run(job);
  load_run_model(run, job);
  choose_trainable(run);
  init_optimizer(run);
  restore_state(run);
  shard_layers(run);
  open_logs(run);
  price_flops(run);
  Evaluator eval(run);
  start_prefetch(run);
  for (int64_t step = run.start; step < run.cfg.schedule.steps; ++step) {
    const StepResult s = train_step(run, step);
    log_step(run, step, s);
    const bool evaluated = eval.due(step);
    if (evaluated) eval.run(step);
    if (checkpoint_due(run, step) || (evaluated && eval.keeps_best())) {
      save_checkpoint(run, step);
      if (evaluated) eval.record_best(step);
    }
  }
  run.pg->barrier();
  return 0;
}

}  // namespace lvx::runtime
