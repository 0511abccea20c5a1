// `lvx plan`: per-layer choice of the distributed attention strategy for a model on a cluster and
// a workload, with every strategy's predicted time and memory and the reason for the choice.
#include <cmath>
#include <fstream>
#include <iostream>

#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/planner/decode_price.h"
#include "src/planner/inference_memory.h"
#include "src/planner/planner.h"
#include "src/planner/question_price.h"
#include "src/planner/train_memory.h"
#include "src/planner/train_report.h"
#include "src/runtime/model_description.h"
#include "src/runtime/train_checkpoint.h"

namespace {

// --memory-reserve-gib: "auto" (TrainMemoryOptions' default reserve, -1) or GiB >= 0.
double memory_reserve(const std::string& v) {
  if (v == "auto") return -1;
  double gib = -1;
  try {
    size_t used = 0;
    gib = std::stod(v, &used);
    if (used != v.size()) gib = -1;
  } catch (const std::exception&) {
  }
  LVX_CHECK(std::isfinite(gib) && gib >= 0 && gib <= 1e6,
            "--memory-reserve-gib: expected auto or a number of GiB >= 0, got '", v, "'");
  return gib * double(int64_t{1} << 30);
}

// --max-frames: the most frames whose whole training memory fits the device less its reserve,
// by bisection (memory grows with frames), for the given settings and for every shard stage ×
// recompute × remat; prints them, names the best, writes --json.
int print_max_frames(const lvx::planner::ModelConfig& model,
                     const lvx::planner::ParamCounts& counts,
                     const lvx::planner::TrainMemoryOptions& mo, int64_t tpf, double device,
                     int64_t question, const std::string& json_path) {
  auto most = [&](const lvx::planner::TrainMemoryOptions& o) {
    auto fits = [&](int64_t f) {
      return lvx::planner::train_memory(model, counts, f, f + question, tpf, o, device).fits;
    };
    int64_t lo = 0, hi = lvx::planner::kMaxPlanVisualTokens / std::max<int64_t>(1, tpf);
    if (!fits(0)) return int64_t{-1};
    while (lo < hi) {
      const int64_t mid = (lo + hi + 1) / 2;
      if (fits(mid))
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  };
  nlohmann::json rows = nlohmann::json::array();
  const int64_t given = most(mo);
  const double reserve = lvx::planner::train_memory(model, counts, 0, 0, tpf, mo, device).reserve;
  std::cout << "memory reserve: " << reserve / double(int64_t{1} << 30) << " GiB of the device's "
            << device / double(int64_t{1} << 30) << " GiB kept free (--memory-reserve-gib)\n";
  std::cout << "max frames (shard " << mo.shard << ", sp-size "
            << (mo.sp_size ? mo.sp_size : mo.ranks) << ", recompute " << mo.recompute << ", remat "
            << mo.remat << "): "
            << (given < 0 ? std::string("none fit (the state alone exceeds the device)")
                          : std::to_string(given))
            << "\n";
  lvx::planner::TrainMemoryOptions best = mo;
  int64_t best_frames = given;
  for (const char* stage : {"none", "optimizer", "gradients", "parameters"})
    for (int rc = 0; rc < 2; ++rc)
      for (int rm = 0; rm < 2; ++rm) {
        lvx::planner::TrainMemoryOptions o = mo;
        o.shard = stage;
        o.recompute = rc;
        o.remat = rm;
        const int64_t f = most(o);
        rows.push_back(
            {{"shard", stage}, {"recompute", bool(rc)}, {"remat", bool(rm)}, {"max_frames", f}});
        if (f > best_frames) best_frames = f, best = o;
      }
  std::cout << "best: " << best_frames << " frames with shard " << best.shard
            << (best.recompute ? ", recompute" : "") << (best.remat ? ", remat" : "") << "\n";
  if (best_frames >= 0)
    std::cout << lvx::planner::format_memory(lvx::planner::train_memory(
        model, counts, best_frames, best_frames + question, tpf, best, device));
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    f << nlohmann::json{{"max_frames", given},
                        {"reserve_bytes", reserve},
                        {"best",
                         {{"max_frames", best_frames},
                          {"shard", best.shard},
                          {"recompute", best.recompute},
                          {"remat", best.remat}}},
                        {"choices", rows},
                        {"fits", given >= 0}}
             .dump(2)
      << "\n";
    LVX_CHECK(f.good(), "--json: cannot write '", json_path, "'");
  }
  return 0;
}

void add_plan_options(lvx::cli::ArgParser& p) {
  p.add_option("model", 'm', "", "model config (configs/models/*.yaml) or a checkpoint directory",
               true);
  p.add_option("cluster", 'c', "", "cluster config (configs/clusters/*.yaml)", true);
  p.add_option("frames", 'f', "", "video frames (or --max-frames)");
  p.add_option("text", 't', "",
               "text tokens S_Q, including one <image> token per frame (with --max-frames: the\n"
               "text besides the frames' tokens; default 64)");
  p.add_option("tokens-per-frame", 'k', "0", "visual tokens per frame (0: the model's)");
  p.add_option("nproc", 'n', "0", "ranks to use (0: every GPU of the cluster)");
  p.add_option("dtype", 0, "", "activation dtype bf16|fp16|fp32 (empty: the model's)");
  p.add_option("layout", 'l', "video_qa",
               "where the frames' tokens sit: video_qa (all frames, then the question) |\n"
               "interleaved (frames spread evenly over the text)");
  p.add_flag("train", 0, "plan forward and backward (training) instead of forward only");
  p.add_option("max-new-tokens", 0, "64",
               "inference: tokens generated after the prompt (their KV cache, for the memory)");
  p.add_flag("no-recompute", 0, "training without LV-XAttn's K/V recomputation for cross layers");
  p.add_flag("paper-accounting", 0,
             "model the LV-XAttn paper's implementations: K/V expanded to the query heads, masked\n"
             "attention computed densely, Ring Attention as one flat ring over every GPU");
  p.add_option("strategies", 's', "",
               "comma list of candidate strategies (empty: all); every strategy is still shown");
  p.add_option("reserve-gib", 0, "0",
               "device memory taken by everything but attention (weights, other activations)");
  p.add_option("json", 'j', "", "also write the plan as JSON to this file");
  // The whole memory of training (src/planner/train_memory.h), mirroring lvx finetune's config.
  p.add_option("shard", 0, "none",
               "training: sharded state none|optimizer|gradients|parameters (parallel.shard)");
  p.add_option("sp-size", 0, "0",
               "training: ranks per sequence-parallel group (parallel.sp_size; 0: all)");
  p.add_option("lora-r", 0, "0", "training: LoRA rank (0: full fine-tuning)");
  p.add_option("freeze", 0, "vision", "training: freeze.policy vision|cross_only|none");
  p.add_option("grad-accum", 0, "1", "training: optimizer.grad_accum");
  p.add_flag("recompute", 0, "training memory: LV-XAttn K/V recomputation (parallel.recompute)");
  p.add_flag("remat", 0, "training memory: rematerialization (parallel.remat)");
  p.add_option("memory-reserve-gib", 0, "auto",
               "training: device memory kept free of the model's peak (CUDA context, NCCL\n"
               "buffers, allocator fragmentation); auto: 1.5 GiB + 8 % of the device");
  p.add_flag("max-frames", 0,
             "training: the most frames whose whole memory fits the device, for the given\n"
             "settings and for the best shard stage / recompute / remat choice");
}

// The whole memory of training's settings (src/planner/train_memory.h), from the flags.
lvx::planner::TrainMemoryOptions memory_options_of(const lvx::cli::ArgParser& p,
                                                   const lvx::planner::ClusterConfig& cluster,
                                                   const std::string& dtype) {
  lvx::planner::TrainMemoryOptions mo;
  mo.shard = p.get("shard");
  mo.ranks = p.get_int("nproc") > 0 ? p.get_int("nproc") : cluster.nodes * cluster.gpus_per_node;
  mo.sp_size = p.get_int("sp-size", 0, mo.ranks);
  LVX_CHECK(mo.sp_size == 0 || mo.ranks % mo.sp_size == 0, "--sp-size: ", mo.sp_size,
            " does not divide the ", mo.ranks, " ranks");
  mo.lora_r = p.get_int("lora-r", 0, 1 << 16);
  mo.grad_accum = p.get_int("grad-accum", 1, 1 << 20);
  mo.recompute = p.flag("recompute");
  mo.remat = p.flag("remat");
  mo.reserve_bytes = memory_reserve(p.get("memory-reserve-gib"));
  mo.elem_bytes = lvx::planner::dtype_bytes(dtype, "--dtype");
  return mo;
}

lvx::planner::Workload workload_of(const lvx::cli::ArgParser& p) {
  lvx::planner::Workload w;
  w.frames = p.get_int("frames");
  w.text_tokens = p.get_int("text");
  w.tokens_per_frame = p.get_int("tokens-per-frame");
  w.ranks = p.get_int("nproc");
  w.dtype = p.get("dtype");
  w.train = p.flag("train");
  w.layout = lvx::planner::prompt_layout_from_string(p.get("layout"));
  for (const std::string& s : p.get_list("strategies"))
    w.strategies.push_back(lvx::attention::strategy_from_name(s));
  return w;
}

lvx::planner::CostOptions cost_options_of(const lvx::cli::ArgParser& p) {
  lvx::planner::CostOptions opt;
  opt.recompute_cross_kv = !p.flag("no-recompute");
  const double reserve_gib = p.get_double("reserve-gib");
  LVX_CHECK(std::isfinite(reserve_gib) && reserve_gib >= 0,
            "--reserve-gib: expected a finite number >= 0, got ", reserve_gib);
  opt.reserved_bytes = reserve_gib * double(1LL << 30);
  if (p.flag("paper-accounting")) opt = lvx::planner::paper_accounting(opt);
  return opt;
}

// A question's decoding priced per token (src/planner/decode_price.h) at 1 rank and at the
// plan's, with --decode-ranks one and all, and the whole question (question_price.h), where the
// cluster config says how fast its memory reads; printed and in the JSON as "decode" and
// "question".
void print_decode_prices(const lvx::planner::ModelConfig& model,
                         const lvx::planner::ClusterConfig& cluster,
                         const lvx::planner::ParamCounts& counts, const lvx::planner::Workload& w,
                         int64_t tokens_per_frame, int64_t elem_bytes, int64_t new_tokens,
                         nlohmann::json& j) {
  if (!lvx::planner::can_price_decode(cluster)) {
    std::cout << "decode per token: not priced (the cluster config has no memory: "
                 "{bandwidth_gb_per_s})\n";
    return;
  }
  lvx::planner::DecodeShape s;
  s.frames = w.frames;
  s.text_tokens = w.text_tokens;
  s.tokens_per_frame = tokens_per_frame;
  s.elem_bytes = elem_bytes;
  s.weight_bytes =
      lvx::planner::decode_weight_bytes(model, counts.layers, counts.vocab, elem_bytes);
  std::vector<lvx::planner::DecodePrice> prices{
      lvx::planner::price_decode(model, cluster, s, 1, true)};
  if (w.ranks > 1)
    for (bool lead : {true, false})
      prices.push_back(lvx::planner::price_decode(model, cluster, s, w.ranks, lead));
  std::cout << lvx::planner::format_decode(prices);
  j["decode"] = nlohmann::json::array();
  for (const auto& p : prices) j["decode"].push_back(lvx::planner::to_json(p));
  // The whole question at 1 rank and at the plan's (what lvx qa --nproc auto compares).
  lvx::planner::QuestionShape q;
  q.frames = w.frames;
  q.text_tokens = w.text_tokens;
  q.tokens_per_frame = tokens_per_frame;
  q.new_tokens = std::max<int64_t>(1, new_tokens);
  q.dtype = w.dtype.empty() ? model.dtype : w.dtype;
  q.lm_parameters = counts.layers;
  q.weight_bytes = s.weight_bytes;
  std::vector<lvx::planner::QuestionPrice> questions{
      lvx::planner::price_question(model, cluster, q, 1)};
  if (w.ranks > 1) questions.push_back(lvx::planner::price_question(model, cluster, q, w.ranks));
  std::cout << "question (prefill, then " << q.new_tokens << " tokens; lvx qa --nproc auto):\n"
            << lvx::planner::format_question(questions, q.new_tokens);
  j["question"] = nlohmann::json::array();
  for (const auto& p : questions) j["question"].push_back(lvx::planner::to_json(p));
}

void write_plan_json(const std::string& json_path, const nlohmann::json& j) {
  std::ofstream f(json_path);
  LVX_CHECK(f.good(), "--json: cannot write '", json_path, "'");
  f << j.dump(2) << "\n";
  f.close();
  LVX_CHECK(!f.fail(), "--json: writing '", json_path, "' failed (disk full?)");
}

int cmd_plan(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx plan --model M.yaml --cluster C.yaml --frames F --text T [options]",
      "Predict forward/backward time and memory per rank of every attention layer under each\n"
      "strategy (lv_xattn, ring, striped, ulysses, all_gather), choose the fastest that fits per\n"
      "layer (in training possibly a forward+backward pair the runtime can run, e.g.\n"
      "lv_xattn+ring), and explain the choice. Mask work is counted from the prompt layout.\n"
      "Formulas: docs/planner.md.");
  add_plan_options(p);
  if (!p.parse(argc, argv)) return 0;
  const std::string json_path = p.get("json");
  if (!json_path.empty()) lvx::check_output_path(json_path, "--json");  // no FIFO, no directory
  const std::string model_path = lvx::runtime::follow_run_folder(p.get("model"));
  lvx::planner::ModelConfig model = lvx::runtime::planner_model(model_path);
  lvx::planner::ClusterConfig cluster = lvx::planner::load_cluster_config(p.get("cluster"));
  const bool max_frames = p.flag("max-frames");
  LVX_CHECK(max_frames || (!p.get("frames").empty() && !p.get("text").empty()),
            "--frames and --text are required (or --train --max-frames)");
  LVX_CHECK(!max_frames || p.flag("train"), "--max-frames plans training memory: add --train");
  const std::string dtype = p.get("dtype").empty() ? model.dtype : p.get("dtype");
  const lvx::planner::TrainMemoryOptions mo = memory_options_of(p, cluster, dtype);
  const int64_t tpf = p.get_int("tokens-per-frame") > 0 ? p.get_int("tokens-per-frame")
                                                        : model.visual_tokens_per_frame;
  const double device = static_cast<double>(cluster.device_memory_bytes);
  lvx::planner::ParamCounts counts;
  if (p.flag("train")) {
    counts = lvx::runtime::count_parameters(model_path, model, p.get("freeze"));
    std::cout << lvx::runtime::describe_parameters(counts, p.get("freeze"), model, mo.lora_r);
  }
  if (max_frames)
    return print_max_frames(model, counts, mo, tpf, device,
                            p.get("text").empty() ? 64 : p.get_int("text"), json_path);
  const lvx::planner::Workload w = workload_of(p);
  const lvx::planner::Plan plan = lvx::planner::plan(model, cluster, w, cost_options_of(p));
  std::cout << lvx::planner::format_table(plan);
  nlohmann::json j = lvx::planner::to_json(plan);
  if (p.flag("train")) {
    std::cout << lvx::planner::train_report(model, counts, plan, w.frames, w.text_tokens, tpf, mo,
                                            cluster, j);
  } else {  // a question's whole memory per rank (src/planner/inference_memory.h)
    counts = lvx::runtime::count_parameters(model_path, model, "vision");
    const auto im = lvx::planner::inference_memory(model, counts, w.frames, w.text_tokens, tpf,
                                                   p.get_int("max-new-tokens", 0, 1 << 30),
                                                   mo.ranks, mo.elem_bytes);
    std::cout << lvx::planner::format_memory(im);
    j["inference_memory"] = lvx::planner::to_json(im);
    print_decode_prices(model, cluster, counts, w, tpf, mo.elem_bytes,
                        p.get_int("max-new-tokens", 0, 1 << 30), j);
  }
  if (!json_path.empty()) write_plan_json(json_path, j);
  return 0;
}

}  // namespace

LVX_COMMAND("plan", "choose the distributed attention strategy per layer and explain it", cmd_plan);
