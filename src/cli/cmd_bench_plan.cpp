// `lvx bench-plan`: runs every feasible strategy of each attention layer of a (small) model on
// real local ranks through `lvx attention`, forward and backward, and the planner's choice too
// when it is a forward+backward pair, and reports predicted against measured time and bytes, and
// the regret of the planner's choice (its measured time over the fastest measured). Inputs carry
// the very mask metadata the planner counted. Without --cluster it first runs `lvx calibrate`.
#include <unistd.h>

#include <algorithm>
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
#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/safetensors.h"
#include "src/dist/launcher.h"
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

// One measured (layer, strategy) point, for the table, the JSON and the plot.
struct Point {
  std::string layer, strategy;
  double predicted_s = 0, measured_s = 0;
  bool choice = false, fastest = false;
};

struct Bench {
  std::string self;
  fs::path dir;
  int reps = 3;
  int rounds = 2;
  at::ScalarType dtype = at::kFloat;
  std::map<std::string, std::map<std::string, AttentionRunStats>> measured_by_key;
  std::map<std::string, double> noise_by_key;  // layers of one shape are measured once
  nlohmann::json layers = nlohmann::json::array();
  std::vector<Point> points;
  std::vector<double> regrets;
  double sum_choice = 0, sum_best = 0;
  std::vector<double> noise;  // per layer: the choice's slowest round / its fastest − 1
  std::ostringstream table;
};

AttentionRunStats measure(Bench& b, const std::string& key, const std::string& in,
                          const std::string& name, const LayerWorkload& w, int64_t nproc) {
  // `lvx attention --repeat R` times R calls after its own warm-up (read_attention_stats takes
  // the fastest).
  const std::string stats = (b.dir / (key + "." + name + ".json")).string();
  std::string out;
  int rc = run(
      {b.self, "attention", "--strategy", name, "--nproc", std::to_string(nproc), "--input", in,
       "--output", (b.dir / (key + ".out.safetensors")).string(), "--mask", attention_mask_flag(w),
       "--backward", "--repeat", std::to_string(b.reps), "--stats", stats},
      &out);
  LVX_CHECK(rc == 0, "bench-plan: lvx attention --strategy ", name, " failed (exit ", rc, "):\n",
            out);
  return read_attention_stats(stats);
}

// Measures every feasible strategy of each planned layer (and the planned pair) in rounds, once
// per distinct layer shape, and adds rows to the table, JSON and points.
void measure_plan(Bench& b, const std::vector<LayerPlan>& plan, const ClusterConfig& cluster,
                  const CostOptions& opt, int64_t nproc, const std::string& prefix) {
  for (const LayerPlan& lp : plan) {
    const std::string key = prefix + layer_key(lp.work);
    auto& measured = b.measured_by_key[key];
    std::vector<lvx::attention::StrategyChoice> runs;
    for (StrategyKind s : lvx::attention::all_strategies())
      if (lp.costs.at(s).feasible) runs.emplace_back(s);
    if (lp.forward != lp.backward) runs.push_back(lp.choice());
    const std::string in = (b.dir / (key + ".safetensors")).string();
    if (measured.empty()) lvx::save_safetensors(in, layer_inputs(lp.work, b.dtype, 1234));
    // A layer of a shape measured before only runs what that one did not.
    runs.erase(std::remove_if(runs.begin(), runs.end(),
                              [&](const auto& c) { return measured.count(c.name()) > 0; }),
               runs.end());
    // Rounds: every strategy once per round, back to back, the order reversed every other round
    // (so that a slow drift of the host does not favour the first); a strategy's time is its
    // fastest round, and the spread of the choice over the rounds is the noise.
    const std::string planned = lp.choice_name();
    std::vector<double> choice_rounds;
    for (int round = 0; round < b.rounds && !runs.empty(); ++round) {
      std::vector<lvx::attention::StrategyChoice> order = runs;
      if (round % 2) std::reverse(order.begin(), order.end());
      for (const auto& choice : order) {
        const std::string name = choice.name();
        AttentionRunStats m = measure(b, key, in, name, lp.work, nproc);
        std::cerr << "bench-plan: " << key << " " << name << " round " << round << ": " << m.seconds
                  << " s\n";
        if (name == planned) choice_rounds.push_back(m.seconds);
        auto it = measured.find(name);
        if (it == measured.end() || m.seconds < it->second.seconds) measured[name] = m;
      }
    }
    if (!choice_rounds.empty())
      b.noise_by_key[key] = *std::max_element(choice_rounds.begin(), choice_rounds.end()) /
                                *std::min_element(choice_rounds.begin(), choice_rounds.end()) -
                            1;
    b.noise.push_back(b.noise_by_key[key]);
    std::map<std::string, double> times;
    nlohmann::json per = nlohmann::json::object();
    double best = 1e300;
    std::string best_s = planned;
    for (const auto& [name, m] : measured) {
      times[name] = m.seconds;
      if (m.seconds < best) best = m.seconds, best_s = name;
    }
    for (const auto& [name, m] : measured) {
      const auto choice = lvx::attention::strategy_choice_from_name(name);
      const StrategyCost &cf = lp.costs.at(choice.forward), &cb = lp.costs.at(choice.backward);
      const double pred = cf.fwd_s + cb.bwd_s;
      const double pred_bytes =
          predicted_bytes_sent(choice, lp.work, cluster, static_cast<int>(nproc), opt);
      per[name] = {{"predicted_s", pred},
                   {"measured_s", m.seconds},
                   {"predicted_bytes_sent", pred_bytes},
                   {"measured_bytes_sent", m.bytes_sent}};
      b.points.push_back({key, name, pred, m.seconds, name == planned, name == best_s});
      b.table << std::setw(4) << lp.index << std::setw(6) << to_string(lp.work.kind)
              << std::setw(15) << name << std::setw(13) << pred << std::setw(13) << m.seconds
              << std::setw(10) << std::setprecision(3) << m.seconds / pred << std::setw(14)
              << pred_bytes << m.bytes_sent << (name == planned ? "   <- choice" : "") << "\n";
    }
    const double rg = regret(times, planned);
    b.regrets.push_back(rg);
    b.sum_choice += times.at(planned);
    b.sum_best += best;
    b.table << "    " << key << ": choice " << planned << ", fastest measured " << best_s
            << ", regret " << std::setprecision(3) << rg << " (the choice's rounds spread by "
            << b.noise.back() * 100 << " %)\n";
    b.layers.push_back({{"index", lp.index},
                        {"key", key},
                        {"kind", to_string(lp.work.kind)},
                        {"ranks", nproc},
                        {"choice", planned},
                        {"fastest_measured", best_s},
                        {"regret", rg},
                        {"noise", b.noise.back()},
                        {"strategies", per}});
  }
}

std::string calibrate(const std::string& self, int64_t nproc, const fs::path& dir) {
  const std::string path = (dir / ("calibrated_" + std::to_string(nproc) + ".yaml")).string();
  std::cerr << "bench-plan: calibrating this machine (lvx calibrate --nproc " << nproc << ")\n";
  std::string out;
  int rc = run({self, "calibrate", "--nproc", std::to_string(nproc), "--output", path}, &out);
  LVX_CHECK(rc == 0, "bench-plan: lvx calibrate failed (exit ", rc, "):\n", out);
  return path;
}

// The grid of single layers `--grid` measures: causal self-attention (short, long) and
// cross-attention with few and many queries against many keys.
std::vector<LayerWorkload> grid_layers() {
  std::vector<LayerWorkload> out;
  auto layer = [](LayerKind kind, int64_t sq, int64_t skv, MaskRule mask) {
    LayerWorkload w;
    w.kind = kind;
    w.sq = sq;
    w.skv = skv;
    w.heads = w.kv_heads = 8;
    w.head_dim = 64;
    w.hidden_size = 512;
    w.visual_feature_dim = 512;
    w.mask = mask;
    w.elem_bytes = 4;
    w.dtype = "fp32";
    return w;
  };
  out.push_back(layer(LayerKind::kSelf, 1024, 1024, MaskRule::kCausal));
  out.push_back(layer(LayerKind::kSelf, 4096, 4096, MaskRule::kCausal));
  out.push_back(layer(LayerKind::kCross, 64, 16384, MaskRule::kNone));
  out.push_back(layer(LayerKind::kCross, 2048, 8192, MaskRule::kNone));
  return out;
}

// predicted against measured time per (layer, strategy), log-log, with the diagonal: a point on
// it is a perfect prediction; the planner's choice is ringed, the fastest measured filled black.
void write_plot(const std::string& path, const std::vector<Point>& pts, const std::string& title) {
  LVX_CHECK(!pts.empty(), "--plot: nothing was measured");
  double lo = 1e300, hi = 0;
  for (const auto& p : pts) {
    lo = std::min({lo, p.predicted_s, p.measured_s});
    hi = std::max({hi, p.predicted_s, p.measured_s});
  }
  lo = std::pow(10, std::floor(std::log10(lo)));
  hi = std::pow(10, std::ceil(std::log10(hi)));
  const double W = 720, H = 560, L = 80, R = 200, T = 40, B = 60;
  auto x = [&](double v) {
    return L + (std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo)) * (W - L - R);
  };
  auto y = [&](double v) {
    return H - B -
           (std::log10(v) - std::log10(lo)) / (std::log10(hi) - std::log10(lo)) * (H - T - B);
  };
  const std::map<std::string, std::string> colours = {
      {"lv_xattn", "#1f77b4"}, {"ring", "#ff7f0e"},       {"striped", "#2ca02c"},
      {"ulysses", "#d62728"},  {"all_gather", "#9467bd"}, {"distflash", "#8c564b"}};
  auto colour = [&](const std::string& s) {
    auto it = colours.find(s);
    return it != colours.end() ? it->second : std::string("#7f7f7f");  // a forward+backward pair
  };
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << W << "\" height=\"" << H
    << "\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" "
       "fill=\"white\"/>\n"
    << "<text x=\"" << L << "\" y=\"24\" font-size=\"14\">" << title << "</text>\n";
  for (double d = lo; d <= hi * 1.0001; d *= 10) {
    o << "<line x1=\"" << x(d) << "\" y1=\"" << T << "\" x2=\"" << x(d) << "\" y2=\"" << H - B
      << "\" stroke=\"#ddd\"/><text x=\"" << x(d) << "\" y=\"" << H - B + 16
      << "\" text-anchor=\"middle\">" << d << "</text>\n";
    o << "<line x1=\"" << L << "\" y1=\"" << y(d) << "\" x2=\"" << W - R << "\" y2=\"" << y(d)
      << "\" stroke=\"#ddd\"/><text x=\"" << L - 6 << "\" y=\"" << y(d) + 4
      << "\" text-anchor=\"end\">" << d << "</text>\n";
  }
  o << "<line x1=\"" << x(lo) << "\" y1=\"" << y(lo) << "\" x2=\"" << x(hi) << "\" y2=\"" << y(hi)
    << "\" stroke=\"black\" stroke-dasharray=\"4 3\"/>\n";
  o << "<text x=\"" << (L + W - R) / 2 << "\" y=\"" << H - 20
    << "\" text-anchor=\"middle\">predicted seconds (forward + backward)</text>\n";
  o << "<text transform=\"translate(20," << (T + H - B) / 2
    << ") rotate(-90)\" text-anchor=\"middle\">measured seconds</text>\n";
  for (const auto& p : pts) {
    o << "<circle cx=\"" << x(p.predicted_s) << "\" cy=\"" << y(p.measured_s)
      << "\" r=\"5\" fill=\"" << (p.fastest ? "black" : colour(p.strategy)) << "\" stroke=\""
      << colour(p.strategy) << "\" stroke-width=\"2\"><title>" << p.layer << " " << p.strategy
      << ": predicted " << p.predicted_s << " s, measured " << p.measured_s
      << " s</title></circle>\n";
    if (p.choice)
      o << "<circle cx=\"" << x(p.predicted_s) << "\" cy=\"" << y(p.measured_s)
        << "\" r=\"9\" fill=\"none\" stroke=\"black\"/>\n";
  }
  double ly = T + 10;
  for (const auto& [name, c] : colours) {
    o << "<circle cx=\"" << W - R + 20 << "\" cy=\"" << ly << "\" r=\"5\" fill=\"" << c
      << "\"/><text x=\"" << W - R + 32 << "\" y=\"" << ly + 4 << "\">" << name << "</text>\n";
    ly += 18;
  }
  o << "<circle cx=\"" << W - R + 20 << "\" cy=\"" << ly
    << "\" r=\"5\" fill=\"#7f7f7f\"/><text x=\"" << W - R + 32 << "\" y=\"" << ly + 4
    << "\">forward+backward pair</text>\n";
  ly += 18;
  o << "<circle cx=\"" << W - R + 20 << "\" cy=\"" << ly
    << "\" r=\"9\" fill=\"none\" stroke=\"black\"/><text x=\"" << W - R + 32 << "\" y=\"" << ly + 4
    << "\">planner's choice</text>\n";
  ly += 18;
  o << "<circle cx=\"" << W - R + 20 << "\" cy=\"" << ly << "\" r=\"5\" fill=\"black\"/><text x=\""
    << W - R + 32 << "\" y=\"" << ly + 4 << "\">fastest measured</text>\n";
  o << "</svg>\n";
  const std::string tmp = path + ".tmp";
  std::ofstream f(tmp);
  f << o.str();
  LVX_CHECK(f.good(), "--plot: cannot write '", path, "'");
  f.close();
  fs::rename(tmp, path);
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
  if (!p.parse(argc, argv)) return 0;
  const bool grid = p.flag("grid");
  LVX_CHECK(grid || !p.get("model").empty(),
            "bench-plan: give --model (with --frames, --text) or --grid");
  Bench b;
  b.self = lvx::dist::self_executable();
  b.dir = p.get("workdir").empty()
              ? fs::temp_directory_path() / ("lvx_bench_plan_" + std::to_string(getpid()))
              : fs::path(p.get("workdir"));
  fs::create_directories(b.dir);
  b.reps = static_cast<int>(p.get_int("reps"));
  b.rounds = static_cast<int>(p.get_int("rounds"));
  LVX_CHECK(b.rounds >= 1 && b.reps >= 1, "--rounds and --reps must be at least 1");
  const std::string dt = p.get("dtype");
  b.dtype = lvx::dtype_of(dt, "--dtype");
  b.table << std::left << std::setw(4) << "#" << std::setw(6) << "kind" << std::setw(15)
          << "strategy" << std::setw(13) << "predicted" << std::setw(13) << "measured"
          << std::setw(10) << "meas/pred" << std::setw(14) << "bytes pred"
          << "bytes meas\n";
  std::string header;
  if (grid) {
    std::vector<int64_t> procs = p.get_int_list("nproc");
    CostOptions opt;
    opt.train = true;
    opt.recompute_cross_kv = false;  // lvx attention times attention alone
    const std::vector<LayerWorkload> layers = grid_layers();
    for (int64_t nproc : procs) {
      const std::string cluster_path =
          p.get("cluster").empty() ? calibrate(b.self, nproc, b.dir) : p.get("cluster");
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
    header = lvx::str("bench-plan: grid of ", layers.size(), " layers on ", p.get("nproc"),
                      " local ranks, forward+backward, fastest of ", b.reps, " calls x ", b.rounds,
                      " rounds");
  } else {
    const int64_t nproc = p.get_int("nproc");
    const std::string cluster_path =
        p.get("cluster").empty() ? calibrate(b.self, nproc, b.dir) : p.get("cluster");
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
    header =
        lvx::str("bench-plan: model ", model.name, ", ", nproc, " local ranks, cluster ",
                 cluster.name, " (", cluster_path, "), frames ", w.frames, ", text ", w.text_tokens,
                 ", forward+backward, fastest of ", b.reps, " calls x ", b.rounds, " rounds");
  }
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
  if (p.get("workdir").empty()) fs::remove_all(b.dir);
  return 0;
}

}  // namespace

LVX_COMMAND("bench-plan", "measure every strategy per layer on local ranks against the planner",
            cmd_bench_plan);
