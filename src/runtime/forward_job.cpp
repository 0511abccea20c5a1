#include "src/runtime/forward_job.h"

#include <malloc.h>
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>

#include "models/checkpoint.h"
#include "models/lora.h"
#include "models/model.h"
#include "src/common/device_sync.h"
#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"
#include "src/dist/process_group.h"
#include "src/runtime/device.h"
#include "src/runtime/generate.h"
#include "src/runtime/layer_plan.h"
#include "src/runtime/model_description.h"
#include "src/runtime/train_step.h"

namespace lvx::runtime {

namespace fs = std::filesystem;
using attention::StrategyChoice;
using attention::StrategyKind;

namespace {

struct Batch {
  at::Tensor input_ids, pixel_values, labels;
  std::map<std::string, at::Tensor> named;  // every other tensor: the family's named inputs
};

Batch read_batch(const std::string& path) {
  TensorFile f = load_safetensors(path);
  LVX_CHECK(f.tensors.count("input_ids"), path, ": has no tensor 'input_ids' (int64 [B, L])");
  Batch b;
  b.input_ids = f.tensors.at("input_ids");
  LVX_CHECK(b.input_ids.dim() == 2 && b.input_ids.scalar_type() == at::kLong, path,
            ": input_ids must be int64 [B, L], got ", b.input_ids.scalar_type(), " ",
            b.input_ids.sizes());
  // pixel_values' layout is the family's (models/model.h): the model checks its rank.
  if (f.tensors.count("pixel_values")) b.pixel_values = f.tensors.at("pixel_values");
  for (const auto& [name, t] : f.tensors)
    if (name != "input_ids" && name != "pixel_values" && name != "labels") b.named[name] = t;
  if (f.tensors.count("labels")) {
    b.labels = f.tensors.at("labels");
    LVX_CHECK(b.labels.sizes() == b.input_ids.sizes() && b.labels.scalar_type() == at::kLong, path,
              ": labels must be int64 with input_ids' shape ", b.input_ids.sizes(), ", got ",
              b.labels.scalar_type(), " ", b.labels.sizes());
  }
  return b;
}

// The logits of every rank in global token order (complete on rank 0 only).
at::Tensor gather_logits(dist::ProcessGroup& pg, attention::LayoutKind layout,
                         const at::Tensor& local) {
  const int n = pg.world_size();
  int64_t total = local.size(1);
  {
    at::Tensor t = at::full({1}, total, at::kLong);
    pg.all_reduce(t);
    total = t.item<int64_t>();
  }
  const attention::Layout text{layout, total, n};
  // Gathered on the host: the file is written there, and rows of every rank meet in one tensor.
  at::Tensor rows = local.detach().to(at::kCPU, at::kFloat).transpose(0, 1).contiguous();
  at::Tensor all = pg.all_gather(rows, text.sizes()).transpose(0, 1);
  std::vector<at::Tensor> shards;
  int64_t off = 0;
  for (int j = 0; j < n; ++j) {
    shards.push_back(all.narrow(1, off, text.local_size(j)));
    off += text.local_size(j);
  }
  return text.unshard(shards, 1).contiguous();
}

}  // namespace

void validate_forward_job(const ForwardJob& job) {
  resolve_dtype(job.dtype, at::Device(at::kCPU), "");
  check_device_option(job.device);  // counts: by the launcher and on each rank
  LVX_CHECK(fs::exists(job.input), job.input, ": no such file");
  check_regular_file(job.input, "input file (--input)");
  check_output_path(job.output, "output file (--output)");
  LVX_CHECK(job.generate >= 0, "--generate must be >= 0, got ", job.generate);
  LVX_CHECK(job.repeat >= 1, "--repeat must be >= 1, got ", job.repeat);
  read_batch(job.input);
  // A known family, from config.json alone: the ranks read the weights, once.
  LVX_CHECK(fs::is_directory(job.model), job.model, ": not a directory (expected a checkpoint ",
            "directory with config.json and model.safetensors)");
  check_model_files(job.model);
  planner_model(job.model);
  if (job.strategies != "auto") explicit_strategies(job.strategies, 1);
  if (!job.adapter.empty())  // --adapter: PEFT's two files (matched to the weights on the ranks)
    for (const char* f : {"adapter_config.json", "adapter_model.safetensors"})
      check_regular_file((fs::path(job.adapter) / f).string(), "LoRA adapter file (--adapter)");
}

namespace {

// What a rank's forward job works on: the model (with its adapter), the batch on the device, the
// layer plan.
struct ForwardRun {
  std::shared_ptr<dist::ProcessGroup> pg;
  at::Device device = at::kCPU;
  std::string dtype;
  Batch batch;
  std::unique_ptr<models::Model> model;
  models::Parallel par;
};

ForwardRun prepare_forward(const ForwardJob& job) {
  ForwardRun run;
  run.pg = dist::ProcessGroup::from_env();
  run.device = choose_device(job.device);
  const std::string ck_dtype = checkpoint_dtype(job.model);
  run.dtype = resolve_dtype(job.dtype, run.device, ck_dtype);
  if (run.pg->rank() == 0)
    if (const std::string note = dtype_note(job.dtype, run.device, ck_dtype, run.dtype);
        !note.empty())
      std::cerr << "lvx: " << note << "\n";
  run.batch = read_batch(job.input);
  Batch& b = run.batch;
  // Frames go to the device once; input_ids and labels are host metadata (models/model.h).
  if (b.pixel_values.defined()) b.pixel_values = b.pixel_values.to(run.device);
  run.model = models::load_model(job.model, dtype_of(run.dtype, "--dtype"), run.device);
  if (!job.adapter.empty()) {  // --adapter: the model with its LoRA adapter (models/lora.h)
    models::LoraAdapter ad = models::load_lora(job.adapter, *run.model);
    run.model = std::make_unique<models::LoraModel>(std::move(run.model), std::move(ad));
  }
  std::string plan_text;
  run.par = plan_layers(*run.model, b.input_ids, run.pg->world_size(),
                        {job.strategies, job.cluster, run.dtype, job.backward}, &plan_text);
  run.par.pg = run.pg;
  run.par.recompute_cross_kv = job.recompute_cross_kv;
  run.par.remat = job.remat;
  run.par.lead_decode = job.lead_decode;
  run.par.lead_threads = job.lead_threads;
  // Every rank must run the same plan on the same inputs.
  run.pg->check_agreement("the model step",
                          str(describe(run.par), " input_ids=", b.input_ids.sizes(), " backward=",
                              job.backward, " dtype=", run.dtype, " device=", run.device.type()));
  if (job.print_plan && run.pg->rank() == 0)
    std::cout << plan_text << "\n" << describe(run.par, run.model.get()) << "\n";
  return run;
}

// --generate N: greedy tokens and each step's logits, with the prefill's and decode's times and
// bytes (rank 0 writes them). With --repeat R > 1: a warm-up generation, then R timed ones whose
// median prefill and per-token times are reported (every run gives the same tokens).
void generate_tokens(const ForwardJob& job, ForwardRun& run) {
  GenerateOptions g;
  g.max_new_tokens = job.generate;
  g.max_length = model_context_length(job.model);  // never past the model's context
  g.keep_logits = true;
  g.prefill_chunk = job.prefill_chunk;
  g.prefill_chunk_keys = job.prefill_chunk_keys;
  const Batch& b = run.batch;
  const models::ModelInputs in{b.input_ids, b.pixel_values, false, b.named};
  GenerateResult out;
  std::vector<double> prefill_s, encode_s, token_s;
  for (int r = 0; r < std::max(1, job.repeat) + (job.repeat > 1 ? 1 : 0); ++r) {
    out = job.generate_rows ? generate_rows(*run.model, in, run.par, g)
                            : generate(*run.model, in, run.par, g);
    if (job.repeat > 1 && r == 0) continue;  // the warm-up
    double per_token = 0;
    for (double t : out.token_seconds)
      per_token += t / static_cast<double>(out.token_seconds.size());
    prefill_s.push_back(out.prefill_seconds);
    encode_s.push_back(out.encode_seconds);
    token_s.push_back(per_token);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  const int64_t steps = std::max<int64_t>(1, out.tokens.size(1) - 1);
  struct rusage ru {};
  getrusage(RUSAGE_SELF, &ru);
  if (run.pg->rank() == 0)
    save_safetensors(
        job.output, {{"tokens", out.tokens}, {"step_logits", out.step_logits}},
        {{"model", job.model},
         {"plan", describe(run.par, run.model.get())},
         {"ranks", std::to_string(run.pg->world_size())},
         {"prefill_seconds", std::to_string(median(prefill_s))},
         {"encode_seconds", std::to_string(median(encode_s))},
         {"decode_seconds_per_token", std::to_string(median(token_s))},
         {"repeats", std::to_string(prefill_s.size())},
         {"peak_rss_bytes", std::to_string(static_cast<int64_t>(ru.ru_maxrss) * 1024)},
         {"prefill_bytes_sent", std::to_string(out.prefill_bytes_sent)},
         {"decode_bytes_sent_per_token", std::to_string(out.decode_bytes_sent / steps)},
         {"prefix_tokens", std::to_string(out.prefix_tokens)},
         {"prefill_chunks", std::to_string(out.prefill_chunks)}});
}

// The timed steps' medians (forward, backward, communication wait), the peak resident set, the
// bytes sent and the live heap after the forward: this rank's, then the slowest rank's.
struct StepTimes {
  std::vector<double> fwd_s, bwd_s, wait_s;
  double live_after_forward = 0;  // heap bytes in use between forward and backward
  at::Tensor slowest(dist::ProcessGroup& pg) const {
    auto median = [](std::vector<double> v) {
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    struct rusage ru {};
    getrusage(RUSAGE_SELF, &ru);
    at::Tensor stats = at::tensor(
        {median(fwd_s), median(bwd_s), median(wait_s), static_cast<double>(ru.ru_maxrss) * 1024.0,
         static_cast<double>(pg.counters().total_sent()), live_after_forward},
        at::kDouble);
    pg.all_reduce(stats, dist::ReduceOp::kMax);
    return stats;
  }
};

// The model step (forward, and the backward with --backward), --repeat times after a warm-up;
// rank 0 writes the logits, the gradients and the step's measurements.
void run_steps(const ForwardJob& job, ForwardRun& run) {
  models::Model& model = *run.model;
  dist::ProcessGroup& pg = *run.pg;
  const Batch& b = run.batch;
  if (job.backward) {
    LVX_CHECK(b.labels.defined(), job.input, ": --backward needs 'labels' (int64 [B, L])");
    for (auto& [name, t] : model.parameters())
      if (model.trainable(name)) t.requires_grad_(true);
  }
  // Timed steps: the first is a warm-up when --repeat > 1; the medians are reported.
  StepTimes times;
  models::ModelOutputs out;
  std::map<std::string, at::Tensor> result;
  for (int step = 0; step < std::max(1, job.repeat) + (job.repeat > 1 ? 1 : 0); ++step) {
    for (auto& [name, t] : model.parameters())
      if (t.grad().defined()) t.mutable_grad() = at::Tensor();
    pg.barrier();
    pg.counters().reset();
    const auto t0 = std::chrono::steady_clock::now();
    out = model.forward({b.input_ids, b.pixel_values, false, b.named}, run.par);
    synchronize(run.device);  // the clock reads the device's work, not its launches
    const auto t1 = std::chrono::steady_clock::now();
    // What the step holds at its peak: weights plus everything the forward saved for the
    // backward (glibc's in-use heap, small and mmapped chunks).
    const struct mallinfo2 mi = mallinfo2();
    times.live_after_forward =
        std::max(times.live_after_forward, static_cast<double>(mi.uordblks + mi.hblkhd));
    if (job.backward) result = backward_step(pg, model, b.labels, out);
    synchronize(run.device);
    const auto t2 = std::chrono::steady_clock::now();
    if (job.repeat > 1 && step == 0) continue;
    times.fwd_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    times.bwd_s.push_back(std::chrono::duration<double>(t2 - t1).count());
    times.wait_s.push_back(pg.counters().wait_seconds);
  }
  const at::Tensor stats = times.slowest(pg);
  result["logits"] = gather_logits(pg, run.par.text_layout, out.logits);
  if (pg.rank() == 0)
    save_safetensors(job.output, result,
                     {{"model", job.model},
                      {"plan", describe(run.par, run.model.get())},
                      {"ranks", std::to_string(pg.world_size())},
                      {"forward_seconds", std::to_string(stats[0].item<double>())},
                      {"backward_seconds", std::to_string(stats[1].item<double>())},
                      {"comm_wait_seconds", std::to_string(stats[2].item<double>())},
                      {"peak_rss_bytes", std::to_string(stats[3].item<double>())},
                      {"bytes_sent", std::to_string(stats[4].item<double>())},
                      {"live_bytes_after_forward", std::to_string(stats[5].item<double>())}});
}

}  // namespace

int run_forward_rank(const ForwardJob& job) {
  ForwardRun run = prepare_forward(job);
  if (job.generate > 0)
    generate_tokens(job, run);
  else
    run_steps(job, run);
  run.pg->barrier();
  return 0;
}

}  // namespace lvx::runtime
