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
  fwd->check_supported(s, n);
  if (job.backward) bwd->check_supported(s, n);
  pg->check_agreement("the attention call",
                      str("strategy=", choice.name(), " ", s.describe(), " backward=", job.backward,
                          " dtype=", f.tensors.at("q").scalar_type()));
  const auto ql = fwd->q_layout(s, n), kl = fwd->kv_layout(s, n);
  attention::LocalInputs in;
  in.q = ql.shard(f.tensors.at("q"), 1, r);
  in.k = kl.shard(f.tensors.at("k"), 1, r);
  in.v = kl.shard(f.tensors.at("v"), 1, r);
  for (auto [name, dst] :
       {std::pair{"q_media", &in.mask.q_media}, std::pair{"kv_media", &in.mask.kv_media},
        std::pair{"kv_valid", &in.mask.kv_valid}})
    if (f.tensors.count(name)) *dst = f.tensors.at(name);
  at::Tensor dout = job.backward ? ql.shard(f.tensors.at("do"), 1, r) : at::Tensor();

  attention::LocalOutput out;
  attention::LocalGrads grads;
  std::vector<double> fwd_s, bwd_s;
  int64_t sent = 0, received = 0, sent_inter = 0;
  for (int it = 0; it < std::max(1, job.repeat); ++it) {
    pg->barrier();
    pg->counters().reset();
    attention::SavedState saved;
    auto t0 = std::chrono::steady_clock::now();
    out = fwd->forward(*pg, s, in, job.backward ? &saved : nullptr);
    auto t1 = std::chrono::steady_clock::now();
    if (job.backward) grads = bwd->backward(*pg, s, in.mask, saved, dout);
    auto t2 = std::chrono::steady_clock::now();
    fwd_s.push_back(std::chrono::duration<double>(t1 - t0).count());
    bwd_s.push_back(std::chrono::duration<double>(t2 - t1).count());
    sent = pg->counters().total_sent();
    sent_inter = pg->counters().sent_inter_node(r, static_cast<int>(s.node_size));
    received = pg->counters().total_received();
  }
  std::map<std::string, at::Tensor> part{{"o", out.o}, {"lse", out.lse.to(at::kFloat)}};
  if (job.backward) {
    part["dq"] = grads.dq;
    part["dk"] = grads.dk;
    part["dv"] = grads.dv;
  }
  check_finite(*pg, part, job.scale);
  const fs::path parts = job.output + ".parts";
  fs::create_directories(parts);
  save_safetensors((parts / str("rank", r, ".safetensors")).string(), part,
                   {{"bytes_sent", std::to_string(sent)},
                    {"bytes_sent_inter_node", std::to_string(sent_inter)},
                    {"bytes_received", std::to_string(received)},
                    {"forward_seconds", std::to_string(median(fwd_s))},
                    {"backward_seconds", std::to_string(median(bwd_s))},
                    {"iteration_seconds", [&] {
                       std::string l;
                       for (size_t i = 0; i < fwd_s.size(); ++i)
                         l += str(i ? "," : "", fwd_s[i] + bwd_s[i]);
                       return l;
                     }()}});
  pg->barrier();
  if (r != 0) return 0;

  std::map<std::string, std::vector<at::Tensor>> shards;
  nlohmann::json ranks = nlohmann::json::array();
  // Each iteration starts at a barrier: its step time is its slowest rank's.
  std::vector<double> step(fwd_s.size(), 0.0);
  for (int j = 0; j < n; ++j) {
    TensorFile pf = load_safetensors((parts / str("rank", j, ".safetensors")).string());
    {
      std::stringstream it(pf.metadata.at("iteration_seconds"));
      std::string x;
      for (size_t i = 0; std::getline(it, x, ',') && i < step.size(); ++i)
        step[i] = std::max(step[i], std::stod(x));
    }
    for (auto& [name, t] : pf.tensors) shards[name].push_back(t);
    const double fs_ = std::stod(pf.metadata.at("forward_seconds"));
    const double bs_ = std::stod(pf.metadata.at("backward_seconds"));
    ranks.push_back({{"rank", j},
                     {"bytes_sent", std::stoll(pf.metadata.at("bytes_sent"))},
                     {"bytes_received", std::stoll(pf.metadata.at("bytes_received"))},
                     {"bytes_sent_inter_node", std::stoll(pf.metadata.at("bytes_sent_inter_node"))},
                     {"seconds", fs_ + bs_},
                     {"forward_seconds", fs_},
                     {"backward_seconds", bs_}});
  }
  std::map<std::string, at::Tensor> result{{"o", ql.unshard(shards["o"], 1)},
                                           {"lse", ql.unshard(shards["lse"], 2)}};
  if (job.backward) {
    result["dq"] = ql.unshard(shards["dq"], 1);
    result["dk"] = kl.unshard(shards["dk"], 1);
    result["dv"] = kl.unshard(shards["dv"], 1);
  }
  save_safetensors(job.output, result, {{"strategy", choice.name()}, {"mask", job.mask}});
  fs::remove_all(parts);
  if (!job.stats.empty()) {
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
  return 0;
}

}  // namespace lvx::runtime
