#include "src/planner/bench_plan.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "src/common/dtype.h"
#include "src/common/error.h"

namespace lvx::planner {

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

}  // namespace lvx::planner
