#include "src/runtime/attention_job.h"

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "src/common/error.h"
#include "src/common/safetensors.h"

namespace lvx::runtime {

namespace fs = std::filesystem;
using attention::AttentionSpec;

kernels::MaskKind mask_kind_from_name(const std::string& name, kernels::MediaRule* rule) {
  *rule = kernels::MediaRule::kImmediate;
  if (name == "none") return kernels::MaskKind::kNone;
  if (name == "causal") return kernels::MaskKind::kCausal;
  if (name == "media_immediate") return kernels::MaskKind::kMedia;
  if (name == "media_upto") {
    *rule = kernels::MediaRule::kUpTo;
    return kernels::MaskKind::kMedia;
  }
  LVX_FAIL("unknown mask '", name, "' (valid: none, causal, media_immediate, media_upto)");
}

namespace {

// A scale that overflows the softmax (--scale 1e300) makes the output NaN: refused on every rank
// at once, before anything is written. lse may be −inf (a query that sees no key), never NaN or
// +inf.
void check_finite(dist::ProcessGroup& pg, const std::map<std::string, at::Tensor>& part,
                  double scale) {
  std::string bad;
  for (const auto& [name, t] : part) {
    const at::Tensor f = t.to(at::kFloat);
    const bool ok = name == "lse"
                        ? !(at::isnan(f).any().item<bool>() || at::isposinf(f).any().item<bool>())
                        : at::isfinite(f).all().item<bool>();
    if (!ok) bad += (bad.empty() ? "" : ", ") + name;
  }
  const std::vector<std::string> errors =
      dist::gather_errors(pg, bad.empty() ? "" : "'" + bad + "' not finite");
  std::string what;
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) what += str(what.empty() ? "" : "; ", "rank ", r, ": ", errors[r]);
  LVX_CHECK(what.empty(), "the attention output is not finite (", what, "): --scale ", scale,
            " overflows the softmax for these inputs; nothing was written");
}

std::string shape_str(const at::Tensor& t) { return str(t.sizes()); }

attention::AttentionSpec spec_from(const AttentionJob& job, const TensorFile& f) {
  for (const char* n : {"q", "k", "v"})
    LVX_CHECK(f.tensors.count(n), job.input, ": has no tensor '", n, "' (needs q, k, v)");
  const at::Tensor &q = f.tensors.at("q"), &k = f.tensors.at("k"), &v = f.tensors.at("v");
  attention::check_qkv(job.input, q, k, v);
  AttentionSpec s;
  s.batch = q.size(0);
  s.sq = q.size(1);
  s.hq = q.size(2);
  s.head_dim = q.size(3);
  s.skv = k.size(1);
  s.hkv = k.size(2);
  s.scale = job.scale;
  s.mask = mask_kind_from_name(job.mask, &s.media_rule);
  if (s.mask == kernels::MaskKind::kMedia)
    for (const char* n : {"q_media", "kv_media"})
      LVX_CHECK(f.tensors.count(n), job.input, ": mask ", job.mask, " needs an int32 tensor '", n,
                "'");
  attention::MaskInputs m;
  for (auto [name, dst] : {std::pair{"q_media", &m.q_media}, std::pair{"kv_media", &m.kv_media},
                           std::pair{"kv_valid", &m.kv_valid}})
    if (f.tensors.count(name)) *dst = f.tensors.at(name);
  attention::check_mask_inputs(job.input, s, m);
  if (job.backward) {
    LVX_CHECK(f.tensors.count("do"), job.input, ": --backward needs the output gradient 'do'");
    LVX_CHECK(f.tensors.at("do").sizes() == q.sizes(), job.input, ": 'do' must have q's shape ",
              shape_str(q), ", got ", shape_str(f.tensors.at("do")));
  }
  return s;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// Both strategies accept the spec, and every rank runs the same call.
void check_strategies(const AttentionJob& job, dist::ProcessGroup& pg, const AttentionSpec& s,
                      int n, const attention::StrategyChoice& choice,
                      const attention::Strategy& fwd, const attention::Strategy& bwd,
                      const TensorFile& f) {
  fwd.check_supported(s, n);
  if (job.backward) bwd.check_supported(s, n);
  pg.check_agreement("the attention call",
                     str("strategy=", choice.name(), " ", s.describe(), " backward=", job.backward,
                         " dtype=", f.tensors.at("q").scalar_type()));
}

// This rank's shards of q, k, v (in the strategy's layouts) and the whole mask metadata.
attention::LocalInputs local_inputs(const TensorFile& f, const attention::Layout& ql,
                                    const attention::Layout& kl, int r) {
  attention::LocalInputs in;
  in.q = ql.shard(f.tensors.at("q"), 1, r);
  in.k = kl.shard(f.tensors.at("k"), 1, r);
  in.v = kl.shard(f.tensors.at("v"), 1, r);
  for (auto [name, dst] :
       {std::pair{"q_media", &in.mask.q_media}, std::pair{"kv_media", &in.mask.kv_media},
        std::pair{"kv_valid", &in.mask.kv_valid}})
    if (f.tensors.count(name)) *dst = f.tensors.at(name);
  return in;
}

// The last call's results, each call's forward and backward seconds, and the last call's bytes.
struct TimedRuns {
  attention::LocalOutput out;
  attention::LocalGrads grads;
  std::vector<double> fwd_s, bwd_s;
  int64_t sent = 0, received = 0, sent_inter = 0;
};

// Runs forward (and backward) job.repeat times, each call starting at a barrier.
TimedRuns run_timed(const AttentionJob& job, dist::ProcessGroup& pg, const AttentionSpec& s,
                    const attention::Strategy& fwd, const attention::Strategy& bwd,
                    const attention::LocalInputs& in, const at::Tensor& dout, int r) {
  TimedRuns t;
  for (int it = 0; it < std::max(1, job.repeat); ++it) {
    pg.barrier();
    pg.counters().reset();
    attention::SavedState saved;
    auto t0 = std::chrono::steady_clock::now();
    t.out = fwd.forward(pg, s, in, job.backward ? &saved : nullptr);
    auto t1 = std::chrono::steady_clock::now();
    if (job.backward) t.grads = bwd.backward(pg, s, in.mask, saved, dout);
    auto t2 = std::chrono::steady_clock::now();
    t.fwd_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    t.bwd_s.push_back(std::chrono::duration<double>(t2 - t1).count());
    t.sent = pg.counters().total_sent();
    t.sent_inter = pg.counters().sent_inter_node(r, static_cast<int>(s.node_size));
    t.received = pg.counters().total_received();
  }
  return t;
}

// Checks this rank's results are finite; writes them, bytes and timings to <parts>/rank<r>.
void write_rank_part(const AttentionJob& job, dist::ProcessGroup& pg, const TimedRuns& t,
                     const fs::path& parts, int r) {
  std::map<std::string, at::Tensor> part{{"o", t.out.o}, {"lse", t.out.lse.to(at::kFloat)}};
  if (job.backward) {
    part["dq"] = t.grads.dq;
    part["dk"] = t.grads.dk;
    part["dv"] = t.grads.dv;
  }
  check_finite(pg, part, job.scale);
  fs::create_directories(parts);
  save_safetensors((parts / str("rank", r, ".safetensors")).string(), part,
                   {{"bytes_sent", std::to_string(t.sent)},
                    {"bytes_sent_inter_node", std::to_string(t.sent_inter)},
                    {"bytes_received", std::to_string(t.received)},
                    {"forward_seconds", std::to_string(median(t.fwd_s))},
                    {"backward_seconds", std::to_string(median(t.bwd_s))},
                    {"iteration_seconds", [&] {
                       std::string l;
                       for (size_t i = 0; i < t.fwd_s.size(); ++i)
                         l += str(i ? "," : "", t.fwd_s[i] + t.bwd_s[i]);
                       return l;
                     }()}});
}

// Every rank's part as read back by rank 0: shards by name, per-rank stats, step times.
struct GatheredParts {
  std::map<std::string, std::vector<at::Tensor>> shards;
  nlohmann::json ranks = nlohmann::json::array();
  std::vector<double> step;
};

// Reads the n ranks' parts: their shards, their bytes and seconds, the slowest rank per call.
GatheredParts gather_parts(const fs::path& parts, int n, size_t calls) {
  GatheredParts g;
  // Each iteration starts at a barrier: its step time is its slowest rank's.
  g.step.assign(calls, 0.0);
  for (int j = 0; j < n; ++j) {
    TensorFile pf = load_safetensors((parts / str("rank", j, ".safetensors")).string());
    {
      std::stringstream it(pf.metadata.at("iteration_seconds"));
      std::string x;
      for (size_t i = 0; std::getline(it, x, ',') && i < g.step.size(); ++i)
        g.step[i] = std::max(g.step[i], std::stod(x));
    }
    for (auto& [name, t] : pf.tensors) g.shards[name].push_back(t);
    const double fs_ = std::stod(pf.metadata.at("forward_seconds"));
    const double bs_ = std::stod(pf.metadata.at("backward_seconds"));
    g.ranks.push_back(
        {{"rank", j},
         {"bytes_sent", std::stoll(pf.metadata.at("bytes_sent"))},
         {"bytes_received", std::stoll(pf.metadata.at("bytes_received"))},
         {"bytes_sent_inter_node", std::stoll(pf.metadata.at("bytes_sent_inter_node"))},
         {"seconds", fs_ + bs_},
         {"forward_seconds", fs_},
         {"backward_seconds", bs_}});
  }
  return g;
}

// Assembles o, lse (and dq, dk, dv) in global token order and writes them to job.output.
void write_result(const AttentionJob& job, const attention::StrategyChoice& choice,
                  const attention::Layout& ql, const attention::Layout& kl,
                  std::map<std::string, std::vector<at::Tensor>>& shards) {
  std::map<std::string, at::Tensor> result{{"o", ql.unshard(shards["o"], 1)},
                                           {"lse", ql.unshard(shards["lse"], 2)}};
  if (job.backward) {
    result["dq"] = ql.unshard(shards["dq"], 1);
    result["dk"] = kl.unshard(shards["dk"], 1);
    result["dv"] = kl.unshard(shards["dv"], 1);
  }
  save_safetensors(job.output, result, {{"strategy", choice.name()}, {"mask", job.mask}});
}

// Writes the stats JSON (per-rank bytes and seconds, step times) atomically to job.stats.
void write_stats(const AttentionJob& job, int n, const nlohmann::json& ranks,
                 const std::vector<double>& step) {
  nlohmann::json j{{"strategy", job.strategy},
                   {"world_size", n},
                   {"mask", job.mask},
                   {"backward", job.backward},
                   {"ranks", ranks},
                   {"step_seconds", step},  // per timed call, its slowest rank
                   {"step_seconds_min", *std::min_element(step.begin(), step.end())},
                   {"step_seconds_median", median(step)}};
  const std::string tmp = job.stats + ".tmp";
  std::ofstream(tmp) << j.dump(2) << "\n";
  fs::rename(tmp, job.stats);
}

}  // namespace

AttentionSpec validate_attention_input(const AttentionJob& job) {
  return spec_from(job, load_safetensors(job.input));
}

int run_attention_rank(const AttentionJob& job) {
  auto pg = dist::ProcessGroup::from_env();
  const int n = pg->world_size(), r = pg->rank();
  TensorFile f = load_safetensors(job.input);
  const AttentionSpec s = attention::with_topology(spec_from(job, f), *pg);
  const attention::StrategyChoice choice = attention::strategy_choice_from_name(job.strategy);
  auto fwd = attention::make_strategy(choice.forward),
       bwd = attention::make_strategy(choice.backward);
  check_strategies(job, *pg, s, n, choice, *fwd, *bwd, f);
  const auto ql = fwd->q_layout(s, n), kl = fwd->kv_layout(s, n);
  attention::LocalInputs in = local_inputs(f, ql, kl, r);
  at::Tensor dout = job.backward ? ql.shard(f.tensors.at("do"), 1, r) : at::Tensor();

  const TimedRuns runs = run_timed(job, *pg, s, *fwd, *bwd, in, dout, r);
  const fs::path parts = job.output + ".parts";
  write_rank_part(job, *pg, runs, parts, r);
  pg->barrier();
  if (r != 0) return 0;

  GatheredParts g = gather_parts(parts, n, runs.fwd_s.size());
  write_result(job, choice, ql, kl, g.shards);
  fs::remove_all(parts);
  if (!job.stats.empty()) write_stats(job, n, g.ranks, g.step);
  return 0;
}

}  // namespace lvx::runtime
