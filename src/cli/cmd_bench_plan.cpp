// `lvx bench-plan`: runs every feasible strategy of each attention layer of a (small) model on
// real local ranks through `lvx attention`, forward and backward, and the planner's choice too
// when it is a forward+backward pair, and reports predicted against measured time and bytes, and
// the regret of the planner's choice (its measured time over the fastest measured). Inputs carry
// the very mask metadata the planner counted. Without --cluster it first runs `lvx calibrate`.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/common/safetensors.h"
#include "src/planner/bench_plan.h"
#include "src/planner/planner.h"
#include "src/runtime/model_description.h"

namespace {

namespace fs = std::filesystem;
using namespace lvx::planner;

std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs a command line; returns its exit code and (merged) output.
int run(const std::vector<std::string>& argv, std::string* output) {
  std::string cmd;
  for (const auto& a : argv) cmd += quote(a) + " ";
  cmd += "2>&1";
  FILE* f = popen(cmd.c_str(), "r");
  LVX_CHECK(f != nullptr, "bench-plan: cannot run ", cmd);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) output->append(buf, n);
  int status = pclose(f);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128;
}

// Same layer shapes measure the same: key of a layer's workload.
std::string layer_key(const LayerWorkload& w) {
  std::ostringstream os;
  os << to_string(w.kind) << w.sq << "x" << w.skv << "h" << w.heads << "-" << w.kv_heads << "d"
     << w.head_dim << to_string(w.mask);  // one prompt layout per run: same shape, same metadata
  return os.str();
}

int cmd_bench_plan(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx bench-plan --model M.yaml --frames F --text T --nproc N [options]",
      "Run every feasible strategy of each attention layer on N local ranks (through `lvx\n"
      "attention --backward`), and compare the measured forward+backward time and bytes with the\n"
      "planner's prediction; report the regret of the planner's choice.");
  p.add_option("model", 'm', "", "model config (a small one: configs/models/tiny.yaml)", true);
  p.add_option("frames", 'f', "", "video frames", true);
  p.add_option("text", 't', "", "text tokens S_Q", true);
  p.add_option("tokens-per-frame", 'k', "0", "visual tokens per frame (0: the model's)");
  p.add_option("nproc", 'n', "2", "local ranks");
  p.add_option("layout", 'l', "video_qa", "prompt layout: video_qa | interleaved");
  p.add_option("cluster", 'c', "", "cluster config of this machine (empty: run lvx calibrate)");
  p.add_option("dtype", 0, "fp32", "dtype of the inputs (CPU kernels: fp32)");
  p.add_option("reps", 'r', "3", "timed calls per strategy (lvx attention --repeat; median)");
  p.add_option("json", 'j', "", "write the results as JSON here");
  p.add_option("workdir", 0, "", "keep inputs and stats here (default: a temporary directory)");
  if (!p.parse(argc, argv)) return 0;
  const std::string self = lvx::dist::self_executable();
  const int64_t nproc = p.get_int("nproc");
  fs::path dir = p.get("workdir").empty()
                     ? fs::temp_directory_path() / ("lvx_bench_plan_" + std::to_string(getpid()))
                     : fs::path(p.get("workdir"));
  fs::create_directories(dir);

  std::string cluster_path = p.get("cluster");
  if (cluster_path.empty()) {
    cluster_path = (dir / "calibrated.yaml").string();
    std::cerr << "bench-plan: calibrating this machine (lvx calibrate --nproc " << nproc << ")\n";
    std::string out;
    int rc =
        run({self, "calibrate", "--nproc", std::to_string(nproc), "--output", cluster_path}, &out);
    LVX_CHECK(rc == 0, "bench-plan: lvx calibrate failed (exit ", rc, "):\n", out);
  }
  ModelConfig model = lvx::runtime::planner_model(p.get("model"));
  ClusterConfig cluster = load_cluster_config(cluster_path);
  LVX_CHECK(nproc <= cluster.world_size(), "--nproc: cluster '", cluster.name, "' has ",
            cluster.world_size(), " ranks, got ", nproc);
  Workload w;
  w.frames = p.get_int("frames");
  w.text_tokens = p.get_int("text");
  w.tokens_per_frame = p.get_int("tokens-per-frame");
  w.ranks = nproc;
  w.dtype = p.get("dtype");
  w.train = true;
  w.layout = prompt_layout_from_string(p.get("layout"));
  Plan plan = lvx::planner::plan(model, cluster, w);
  const at::ScalarType dtype = w.dtype == "fp32"   ? at::kFloat
                               : w.dtype == "bf16" ? at::kBFloat16
                                                   : at::kHalf;
  const int reps = static_cast<int>(p.get_int("reps"));

  std::map<std::string, std::map<std::string, AttentionRunStats>> measured_by_key;
  nlohmann::json layers = nlohmann::json::array();
  double sum_choice = 0, sum_best = 0;
  std::ostringstream table;
  table << std::left << std::setw(4) << "#" << std::setw(6) << "kind" << std::setw(15) << "strategy"
        << std::setw(13) << "predicted" << std::setw(13) << "measured" << std::setw(10)
        << "meas/pred" << std::setw(14) << "bytes pred"
        << "bytes meas\n";
  for (const LayerPlan& lp : plan.layers) {
    const std::string key = layer_key(lp.work);
    auto& measured = measured_by_key[key];
    // Every feasible single strategy, and the planned choice when it is a pair.
    std::vector<lvx::attention::StrategyChoice> runs;
    for (StrategyKind s : lvx::attention::all_strategies())
      if (lp.costs.at(s).feasible) runs.emplace_back(s);
    if (lp.forward != lp.backward) runs.push_back(lp.choice());
    const std::string in = (dir / (key + ".safetensors")).string();
    if (measured.empty()) lvx::save_safetensors(in, layer_inputs(lp.work, dtype, 1234));
    for (const auto& choice : runs) {
      const std::string name = choice.name();
      if (measured.count(name)) continue;
      // `lvx attention --repeat R` times R calls after its own warm-up and reports the median.
      const std::string stats = (dir / (key + "." + name + ".json")).string();
      std::string out;
      int rc = run({self, "attention", "--strategy", name, "--nproc", std::to_string(nproc),
                    "--input", in, "--output", (dir / (key + ".out.safetensors")).string(),
                    "--mask", attention_mask_flag(lp.work), "--backward", "--repeat",
                    std::to_string(reps), "--stats", stats},
                   &out);
      LVX_CHECK(rc == 0, "bench-plan: lvx attention --strategy ", name, " failed (exit ", rc,
                "):\n", out);
      measured[name] = read_attention_stats(stats);
      std::cerr << "bench-plan: " << key << " " << name << " " << measured[name].seconds << " s\n";
    }
    std::map<std::string, double> times;
    nlohmann::json per = nlohmann::json::object();
    for (const auto& [name, m] : measured) {
      const auto choice = lvx::attention::strategy_choice_from_name(name);
      const StrategyCost &cf = lp.costs.at(choice.forward), &cb = lp.costs.at(choice.backward);
      const double pred = cf.fwd_s + cb.bwd_s;
      const double pred_bytes = cf.bytes_sent.forward + cb.bytes_sent.backward;
      times[name] = m.seconds;
      per[name] = {{"predicted_s", pred},
                           {"measured_s", m.seconds},
                           {"predicted_bytes_sent", pred_bytes},
                           {"measured_bytes_sent", m.bytes_sent}};
      table << std::setw(4) << lp.index << std::setw(6) << to_string(lp.work.kind) << std::setw(15)
            << name << std::setw(13) << pred << std::setw(13) << m.seconds << std::setw(10)
            << std::setprecision(3) << m.seconds / pred << std::setw(14) << pred_bytes
            << m.bytes_sent << (name == lp.choice_name() ? "   <- choice" : "") << "\n";
    }
    const std::string planned = lp.choice_name();
    const double rg = regret(times, planned);
    double best = 1e300;
    std::string best_s = planned;
    for (const auto& [name, t] : times) {
      if (t < best) best = t, best_s = name;
    }
    sum_choice += times.at(planned);
    sum_best += best;
    table << "    choice " << planned << ", fastest measured " << best_s << ", regret "
          << std::setprecision(3) << rg << "\n";
    layers.push_back({{"index", lp.index},
                      {"kind", to_string(lp.work.kind)},
                      {"choice", planned},
                      {"fastest_measured", best_s},
                      {"regret", rg},
                      {"strategies", per}});
  }
  std::cout << "bench-plan: model " << model.name << ", " << nproc << " local ranks, cluster "
            << cluster.name << " (" << cluster_path << "), frames " << w.frames << ", text "
            << w.text_tokens << ", forward+backward, median of " << reps << " calls\n"
            << table.str()
            << "total regret (sum of chosen / sum of fastest): " << std::setprecision(3)
            << sum_choice / sum_best << "\n";
  if (!p.get("json").empty()) {
    std::ofstream f(p.get("json"));
    f << nlohmann::json{{"model", model.name},
                        {"cluster", cluster.name},
                        {"nproc", nproc},
                        {"frames", w.frames},
                        {"text", w.text_tokens},
                        {"layers", layers},
                        {"total_regret", sum_choice / sum_best}}
             .dump(2)
      << "\n";
    LVX_CHECK(f.good(), "--json: cannot write '", p.get("json"), "'");
  }
  if (p.get("workdir").empty()) fs::remove_all(dir);
  return 0;
}

}  // namespace

LVX_COMMAND("bench-plan", "measure every strategy per layer on local ranks against the planner",
            cmd_bench_plan);
