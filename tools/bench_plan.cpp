#include "tools/bench_plan.h"

#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/safetensors.h"

namespace lvx::tools {

using namespace planner;

std::map<std::string, at::Tensor> layer_inputs(const LayerWorkload& w, at::ScalarType dtype,
                                               uint64_t seed) {
  at::manual_seed(seed);
  auto opt = at::TensorOptions().dtype(dtype);
  std::map<std::string, at::Tensor> t;
  t["q"] = at::randn({1, w.sq, w.heads, w.head_dim}, opt);
  t["k"] = at::randn({1, w.skv, w.kv_heads, w.head_dim}, opt);
  t["v"] = at::randn({1, w.skv, w.kv_heads, w.head_dim}, opt);
  t["do"] = at::randn({1, w.sq, w.heads, w.head_dim}, opt);
  if (w.mask == MaskRule::kMediaUpTo || w.mask == MaskRule::kMediaImmediate) {
    t["q_media"] = w.counter().q_media().contiguous();
    t["kv_media"] = w.counter().kv_media().contiguous();
  }
  return t;
}

std::string attention_mask_flag(const LayerWorkload& w) { return to_string(w.mask); }

double predicted_bytes_sent(const attention::StrategyChoice& choice, const LayerWorkload& w,
                            const ClusterConfig& c, int n, const CostOptions& opt) {
  const attention::AttentionSpec spec = layer_spec(w, c, opt);
  const auto f = attention::make_strategy(choice.forward),
             b = attention::make_strategy(choice.backward);
  const at::ScalarType dt = dtype_of(w.dtype, "workload dtype");
  int64_t most = 0;
  for (int r = 0; r < n; ++r)
    most = std::max(most, f->analytic_bytes(spec, n, r, dt, false).sent +
                              b->analytic_bytes(spec, n, r, dt, true).sent);
  return static_cast<double>(most);
}

AttentionRunStats read_attention_stats(const std::string& path) {
  std::ifstream f(path);
  LVX_CHECK(f.good(), path, ": cannot open (did lvx attention write --stats?)");
  nlohmann::json j;
  try {
    f >> j;
  } catch (const nlohmann::json::exception& e) {
    LVX_FAIL(path, ": invalid JSON: ", e.what());
  }
  LVX_CHECK(j.contains("ranks") && j["ranks"].is_array() && !j["ranks"].empty(), path,
            ": ranks: missing or empty");
  AttentionRunStats s;
  for (size_t i = 0; i < j["ranks"].size(); ++i) {
    const auto& r = j["ranks"][i];
    for (const char* k : {"seconds", "bytes_sent"}) {
      LVX_CHECK(r.contains(k) && r[k].is_number(), path, ": ranks[", i, "].", k, ": missing");
    }
    s.seconds = std::max(s.seconds, r["seconds"].get<double>());
    s.bytes_sent = std::max(s.bytes_sent, r["bytes_sent"].get<double>());
  }
  // The fastest of the timed calls (each its slowest rank's time): on a shared host the slower
  // calls measure other processes.
  if (j.contains("step_seconds_min") && j["step_seconds_min"].is_number())
    s.seconds = j["step_seconds_min"].get<double>();
  return s;
}

double regret(const std::map<std::string, double>& measured, const std::string& choice) {
  auto it = measured.find(choice);
  if (it == measured.end()) return std::numeric_limits<double>::quiet_NaN();
  double best = std::numeric_limits<double>::infinity();
  for (const auto& [s, t] : measured) best = std::min(best, t);
  return it->second / best;
}

namespace {

namespace fs = std::filesystem;

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

AttentionRunStats measure(Bench& b, const std::string& key, const std::string& in,
                          const std::string& name, const LayerWorkload& w, int64_t nproc) {
  // `lvx attention --repeat R` times R calls after its own warm-up (read_attention_stats takes
  // the fastest).
  const std::string stats = (b.dir / (key + "." + name + ".json")).string();
  std::string out;
  std::vector<std::string> argv{b.self, "attention", "--strategy", name};
  if (b.links.empty()) {
    argv.insert(argv.end(), {"--nproc", std::to_string(nproc)});
  } else {  // the ranks of an emulated cluster, each running `lvx attention` as one rank
    std::vector<std::string> launch{b.self, "launch", "--nproc", std::to_string(nproc)};
    launch.insert(launch.end(), b.links.begin(), b.links.end());
    launch.push_back("--");
    argv.insert(argv.begin(), launch.begin(), launch.end());
  }
  argv.insert(argv.end(), {"--input", in, "--output",
                           (b.dir / (key + ".out.safetensors")).string(), "--mask",
                           attention_mask_flag(w), "--backward", "--repeat",
                           std::to_string(b.reps), "--stats", stats});
  int rc = run(argv, &out);
  LVX_CHECK(rc == 0, "bench-plan: lvx attention --strategy ", name, " failed (exit ", rc, "):\n",
            out);
  return read_attention_stats(stats);
}

}  // namespace

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

std::string calibrate(const Bench& b, int64_t nproc) {
  const std::string path = (b.dir / ("calibrated_" + std::to_string(nproc) + ".yaml")).string();
  std::vector<std::string> argv{b.self, "calibrate", "--nproc", std::to_string(nproc), "--output",
                                path};
  argv.insert(argv.end(), b.links.begin(), b.links.end());
  std::string line;
  for (size_t i = 1; i < argv.size(); ++i) line += " " + argv[i];
  std::cerr << "bench-plan: calibrating (lvx" << line << ")\n";
  std::string out;
  int rc = run(argv, &out);
  LVX_CHECK(rc == 0, "bench-plan: lvx calibrate failed (exit ", rc, "):\n", out);
  return path;
}

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

}  // namespace lvx::tools
