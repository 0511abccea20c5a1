// `lvx bench-plan`: runs every feasible strategy of each attention layer of a (small) model on
// real local ranks through `lvx attention`, forward and backward, and the planner's choice too
// when it is a forward+backward pair, and reports predicted against measured time and bytes, and
// the regret of the planner's choice (its measured time over the fastest measured). Inputs carry
// the very mask metadata the planner counted. Without --cluster it first runs `lvx calibrate`.
// This file parses the flags and prints; the harness and the plot are tools/bench_plan.h and
// tools/bench_plot.h.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "src/cli/args.h"
#include "src/cli/cluster_options.h"
#include "src/cli/command.h"
#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/planner/planner.h"
#include "src/runtime/model_description.h"
#include "tools/bench_plan.h"
#include "tools/bench_plot.h"

namespace {

namespace fs = std::filesystem;
using namespace lvx::planner;
using namespace lvx::tools;

// The emulated cluster's launch options, the rates fixed once (--emulate times this machine
// here, so that every run and the calibration see the same links).
std::vector<std::string> link_args(const lvx::cli::ArgParser& p) {
  const int64_t nodes = p.get_int("nodes", 1, 254);
  const std::vector<int64_t> procs = p.get_int_list("nproc");
  const lvx::dist::LinkRates r = lvx::cli::link_rates(p, static_cast<int>(procs.front()));
  if (!r.enabled()) {
    LVX_CHECK(nodes == 1, "--nodes needs --inter-node or --emulate (emulated links)");
    return {};
  }
  auto bits = [](double bytes_per_s) {
    return std::to_string(static_cast<int64_t>(bytes_per_s * 8)) + "bit";
  };
  std::vector<std::string> a{"--nodes", std::to_string(nodes), "--inter-node",
                             bits(r.inter_node_bytes_per_s)};
  if (r.intra_node_bytes_per_s > 0)
    a.insert(a.end(), {"--intra-node", bits(r.intra_node_bytes_per_s)});
  return a;
}

// The options of `lvx bench-plan`.
void add_bench_plan_options(lvx::cli::ArgParser& p) {
  p.add_option("model", 'm', "", "model config (a small one: configs/models/tiny.yaml)");
  p.add_option("frames", 'f', "0", "video frames");
  p.add_option("text", 't', "0", "text tokens S_Q");
  p.add_flag("grid", 0, "measure the built-in grid of single layers instead of a model");
  p.add_option("tokens-per-frame", 'k', "0", "visual tokens per frame (0: the model's)");
  p.add_option("nproc", 'n', "2", "local ranks (with --grid: a comma list, e.g. 2,4)");
  p.add_option("layout", 'l', "video_qa", "prompt layout: video_qa | interleaved");
  p.add_option("cluster", 'c', "", "cluster config of this machine (empty: run lvx calibrate)");
  p.add_option("dtype", 0, "fp32", "dtype of the inputs (CPU kernels: fp32)");
  p.add_option("reps", 'r', "3",
               "timed calls per strategy and round (lvx attention --repeat; the fastest counts)");
  p.add_option("rounds", 0, "2",
               "rounds over the strategies of a layer (each strategy's time: its fastest round)");
  p.add_option("json", 'j', "", "write the results as JSON here");
  p.add_option("plot", 0, "", "draw predicted against measured time per layer and strategy (SVG)");
  p.add_option("workdir", 0, "", "keep inputs and stats here (default: a temporary directory)");
  p.add_option("nodes", 0, "1",
               "with --inter-node or --emulate: measure on this many emulated nodes (lvx launch)");
  lvx::cli::add_link_options(p);
}

// The harness from the flags: this executable, the work folder (created), the emulated links,
// reps, rounds and the inputs' dtype.
Bench bench_of(const lvx::cli::ArgParser& p) {
  Bench b;
  b.self = lvx::dist::self_executable();
  b.dir = p.get("workdir").empty()
              ? fs::temp_directory_path() / ("lvx_bench_plan_" + std::to_string(getpid()))
              : fs::path(p.get("workdir"));
  fs::create_directories(b.dir);
  b.links = link_args(p);
  b.reps = static_cast<int>(p.get_int("reps"));
  b.rounds = static_cast<int>(p.get_int("rounds"));
  LVX_CHECK(b.rounds >= 1 && b.reps >= 1, "--rounds and --reps must be at least 1");
  const std::string dt = p.get("dtype");
  b.dtype = lvx::dtype_of(dt, "--dtype");
  return b;
}

// The results table's header row.
void write_table_header(std::ostringstream& table) {
  table << std::left << std::setw(4) << "#" << std::setw(6) << "kind" << std::setw(15) << "strategy"
        << std::setw(13) << "predicted" << std::setw(13) << "measured" << std::setw(10)
        << "meas/pred" << std::setw(14) << "bytes pred"
        << "bytes meas\n";
}

// --grid: measures the built-in grid of single layers for each --nproc value (calibrating for
// each unless --cluster); returns the report's title.
std::string measure_grid(const lvx::cli::ArgParser& p, Bench& b) {
  const std::string dt = p.get("dtype");
  std::vector<int64_t> procs = p.get_int_list("nproc");
  CostOptions opt;
  opt.train = true;
  opt.recompute_cross_kv = false;  // lvx attention times attention alone
  const std::vector<LayerWorkload> layers = grid_layers();
  for (int64_t nproc : procs) {
    const std::string cluster_path =
        p.get("cluster").empty() ? calibrate(b, nproc) : p.get("cluster");
    ClusterConfig cluster = load_cluster_config(cluster_path);
    LVX_CHECK(nproc <= cluster.world_size(), "--nproc: cluster '", cluster.name, "' has ",
              cluster.world_size(), " ranks, got ", nproc);
    std::vector<LayerPlan> plan;
    for (size_t i = 0; i < layers.size(); ++i) {
      LayerWorkload w = layers[i];
      w.dtype = dt;
      w.elem_bytes = lvx::attention::element_bytes(b.dtype);
      plan.push_back(plan_layer(static_cast<int>(i), w, cluster, nproc, opt, true));
    }
    measure_plan(b, plan, cluster, opt, nproc, "n" + std::to_string(nproc) + "-");
  }
  return lvx::str("bench-plan: grid of ", layers.size(), " layers on ", p.get("nproc"),
                  " local ranks, forward+backward, fastest of ", b.reps, " calls x ", b.rounds,
                  " rounds");
}

// --model: plans the model's workload for training on --nproc ranks (calibrating unless
// --cluster) and measures every layer; returns the report's title.
std::string measure_model(const lvx::cli::ArgParser& p, Bench& b) {
  const std::string dt = p.get("dtype");
  const int64_t nproc = p.get_int("nproc");
  const std::string cluster_path =
      p.get("cluster").empty() ? calibrate(b, nproc) : p.get("cluster");
  ModelConfig model = lvx::runtime::planner_model(p.get("model"));
  ClusterConfig cluster = load_cluster_config(cluster_path);
  LVX_CHECK(nproc <= cluster.world_size(), "--nproc: cluster '", cluster.name, "' has ",
            cluster.world_size(), " ranks, got ", nproc);
  Workload w;
  w.frames = p.get_int("frames");
  w.text_tokens = p.get_int("text");
  LVX_CHECK(w.frames > 0 && w.text_tokens > 0, "bench-plan: --model needs --frames and --text");
  w.tokens_per_frame = p.get_int("tokens-per-frame");
  w.ranks = nproc;
  w.dtype = dt;
  w.train = true;
  w.layout = prompt_layout_from_string(p.get("layout"));
  Plan plan = lvx::planner::plan(model, cluster, w);
  measure_plan(b, plan.layers, cluster, plan.options, nproc, "");
  return lvx::str("bench-plan: model ", model.name, ", ", nproc, " local ranks, cluster ",
                  cluster.name, " (", cluster_path, "), frames ", w.frames, ", text ",
                  w.text_tokens, ", forward+backward, fastest of ", b.reps, " calls x ", b.rounds,
                  " rounds");
}

// Prints the title, the table, the regret and the noise; writes --json and --plot if given.
void report_results(const lvx::cli::ArgParser& p, const Bench& b, const std::string& header) {
  const double worst = *std::max_element(b.regrets.begin(), b.regrets.end());
  std::vector<double> noise = b.noise;
  std::sort(noise.begin(), noise.end());
  const double median_noise = noise[noise.size() / 2];
  std::cout << header << "\n"
            << b.table.str() << std::setprecision(3)
            << "total regret (sum of chosen / sum of fastest): " << b.sum_choice / b.sum_best
            << "\nlargest regret of a layer: " << worst
            << "\nmeasurement noise (spread of the choice over the rounds): median " << median_noise
            << ", largest " << noise.back() << "\n";
  if (!p.get("json").empty()) {
    std::ofstream f(p.get("json"));
    f << nlohmann::json{{"nproc", p.get("nproc")},
                        {"layers", b.layers},
                        {"total_regret", b.sum_choice / b.sum_best},
                        {"max_regret", worst},
                        {"median_noise", median_noise}}
             .dump(2)
      << "\n";
    LVX_CHECK(f.good(), "--json: cannot write '", p.get("json"), "'");
  }
  if (!p.get("plot").empty()) write_plot(p.get("plot"), b.points, header);
}

int cmd_bench_plan(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx bench-plan (--model M.yaml --frames F --text T | --grid) --nproc N [options]",
      "Run every feasible strategy of each attention layer on N local ranks (through `lvx\n"
      "attention --backward`), and compare the measured forward+backward time and bytes with the\n"
      "planner's prediction; report the regret of the planner's choice (its measured time over\n"
      "the fastest measured) per layer and in total, and the measurement noise (the spread of\n"
      "the choice over --rounds rounds). --grid measures a built-in grid of single layers (causal "
      "self-attention\n"
      "of 1k and 4k tokens, cross-attention of 64 and 2k queries to 16k and 8k keys) for each of\n"
      "the --nproc values (a comma list), calibrating for each.");
  add_bench_plan_options(p);
  if (!p.parse(argc, argv)) return 0;
  const bool grid = p.flag("grid");
  LVX_CHECK(grid || !p.get("model").empty(),
            "bench-plan: give --model (with --frames, --text) or --grid");
  Bench b = bench_of(p);
  write_table_header(b.table);
  const std::string header = grid ? measure_grid(p, b) : measure_model(p, b);
  report_results(p, b, header);
  if (p.get("workdir").empty()) fs::remove_all(b.dir);
  return 0;
}

}  // namespace

LVX_COMMAND("bench-plan", "measure every strategy per layer on local ranks against the planner",
            cmd_bench_plan);
