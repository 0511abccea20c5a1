// `lvx plan`: per-layer choice of the distributed attention strategy for a model on a cluster and
// a workload, with every strategy's predicted time and memory and the reason for the choice.
#include <cmath>
#include <fstream>
#include <iostream>

#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/planner/planner.h"
#include "src/runtime/model_description.h"

namespace {

int cmd_plan(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx plan --model M.yaml --cluster C.yaml --frames F --text T [options]",
      "Predict forward/backward time and memory per rank of every attention layer under each\n"
      "strategy (lv_xattn, ring, striped, ulysses, all_gather), choose the fastest that fits per\n"
      "layer (in training possibly a forward+backward pair the runtime can run, e.g.\n"
      "lv_xattn+ring), and explain the choice. Mask work is counted from the prompt layout.\n"
      "Formulas: docs/planner.md.");
  p.add_option("model", 'm', "", "model config (configs/models/*.yaml) or a checkpoint directory",
               true);
  p.add_option("cluster", 'c', "", "cluster config (configs/clusters/*.yaml)", true);
  p.add_option("frames", 'f', "", "video frames", true);
  p.add_option("text", 't', "", "text tokens S_Q, including one <image> token per frame", true);
  p.add_option("tokens-per-frame", 'k', "0", "visual tokens per frame (0: the model's)");
  p.add_option("nproc", 'n', "0", "ranks to use (0: every GPU of the cluster)");
  p.add_option("dtype", 0, "", "activation dtype bf16|fp16|fp32 (empty: the model's)");
  p.add_option("layout", 'l', "video_qa",
               "where the frames' tokens sit: video_qa (all frames, then the question) |\n"
               "interleaved (frames spread evenly over the text)");
  p.add_flag("train", 0, "plan forward and backward (training) instead of forward only");
  p.add_flag("no-recompute", 0, "training without LV-XAttn's K/V recomputation for cross layers");
  p.add_flag("paper-accounting", 0,
             "model the LV-XAttn paper's implementations: K/V expanded to the query heads, masked\n"
             "attention computed densely, Ring Attention as one flat ring over every GPU");
  p.add_option("strategies", 's', "",
               "comma list of candidate strategies (empty: all); every strategy is still shown");
  p.add_option("reserve-gib", 0, "0",
               "device memory taken by everything but attention (weights, other activations)");
  p.add_option("json", 'j', "", "also write the plan as JSON to this file");
  if (!p.parse(argc, argv)) return 0;
  const std::string json_path = p.get("json");
  if (!json_path.empty()) lvx::check_output_path(json_path, "--json");  // no FIFO, no directory
  lvx::planner::ModelConfig model = lvx::runtime::planner_model(p.get("model"));
  lvx::planner::ClusterConfig cluster = lvx::planner::load_cluster_config(p.get("cluster"));
  lvx::planner::Workload w;
  w.frames = p.get_int("frames");
  w.text_tokens = p.get_int("text");
  w.tokens_per_frame = p.get_int("tokens-per-frame");
  w.ranks = p.get_int("nproc");
  w.dtype = p.get("dtype");
  w.train = p.flag("train");
  w.layout = lvx::planner::prompt_layout_from_string(p.get("layout"));
  for (const std::string& s : p.get_list("strategies")) {
    w.strategies.push_back(lvx::attention::strategy_from_name(s));
  }
  lvx::planner::CostOptions opt;
  opt.recompute_cross_kv = !p.flag("no-recompute");
  const double reserve_gib = p.get_double("reserve-gib");
  LVX_CHECK(std::isfinite(reserve_gib) && reserve_gib >= 0,
            "--reserve-gib: expected a finite number >= 0, got ", reserve_gib);
  opt.reserved_bytes = reserve_gib * double(1LL << 30);
  if (p.flag("paper-accounting")) opt = lvx::planner::paper_accounting(opt);
  lvx::planner::Plan plan = lvx::planner::plan(model, cluster, w, opt);
  std::cout << lvx::planner::format_table(plan);
  if (!json_path.empty()) {
    std::ofstream f(json_path);
    LVX_CHECK(f.good(), "--json: cannot write '", json_path, "'");
    f << lvx::planner::to_json(plan).dump(2) << "\n";
    f.close();
    LVX_CHECK(!f.fail(), "--json: writing '", json_path, "' failed (disk full?)");
  }
  return 0;
}

}  // namespace

LVX_COMMAND("plan", "choose the distributed attention strategy per layer and explain it", cmd_plan);
