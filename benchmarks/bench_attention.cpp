// Distributed attention benchmark: for a sweep of (Sq, Skv, heads, K/V heads, head dim) on N
// local ranks, every strategy's forward+backward time and bytes per rank side by side, after a
// correctness check of each strategy's output against single-device attention of the same
// rank's queries (fp32, max abs error printed). Ratios are against ring (the baseline LV-XAttn
// is compared with in its paper).
//   bench_attention [--nproc 4] [--sq 256,1024] [--skv 16384] [--heads 8] [--kv-heads 8]
//                   [--head-dim 64] [--mask none] [--iters 3] [-o md|json]
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>

#include "src/attention/strategy.h"
#include "src/cli/args.h"
#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/runtime/attention_job.h"

using namespace lvx;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// What every configuration's runs share: the process group, its size and this rank, -o json,
// and --iters.
struct Bench {
  dist::ProcessGroup& pg;
  int n, r;
  bool json;
  int iters;
};

// One configuration (Sq, Skv, heads, K/V heads, head dim) and --mask.
attention::AttentionSpec make_spec(const cli::ArgParser& p, int64_t sq, int64_t skv, int64_t hq,
                                   int64_t hkv, int64_t d) {
  attention::AttentionSpec s;
  s.sq = sq;
  s.skv = skv;
  s.hq = hq;
  s.hkv = hkv;
  s.head_dim = d;
  s.mask = runtime::mask_kind_from_name(p.get("mask"), &s.media_rule);
  return s;
}

// The whole inputs of a configuration, the same on every rank (seeded).
struct Inputs {
  at::Tensor q, k, v, dout;
};

Inputs make_inputs(const attention::AttentionSpec& s) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto q = at::randn({1, s.sq, s.hq, s.head_dim}, gen),
       k = at::randn({1, s.skv, s.hkv, s.head_dim}, gen);
  auto v = at::randn({1, s.skv, s.hkv, s.head_dim}, gen),
       dout = at::randn({1, s.sq, s.hq, s.head_dim}, gen);
  return {q, k, v, dout};
}

// Correctness first: this rank's output against single-device attention of its queries over
// the whole K/V; the largest error over the ranks.
at::Tensor max_error(const Bench& b, attention::Strategy& st, const attention::AttentionSpec& s,
                     const attention::LocalInputs& in, const attention::Layout& ql,
                     const Inputs& x) {
  auto out = st.forward(b.pg, s, in, nullptr);
  const auto qpos = ql.positions(b.r);
  auto ref = kernels::attention_forward(
      in.q, x.k, x.v, attention::block_params(s, in.mask, qpos, at::arange(s.skv)));
  at::Tensor err =
      at::full({1}, in.q.size(1) ? (out.o.to(at::kFloat) - ref.o).abs().max().item<double>() : 0.0,
               at::kDouble);
  b.pg.all_reduce(err, dist::ReduceOp::kMax);
  return err;
}

// Median forward and backward seconds over --iters and the bytes this rank sent in one step,
// each the slowest rank's: [fwd s, bwd s, bytes] (fp64).
at::Tensor time_strategy(const Bench& b, attention::Strategy& st, const attention::AttentionSpec& s,
                         const attention::LocalInputs& in, const attention::Layout& ql,
                         const Inputs& x) {
  std::vector<double> tf, tb;
  int64_t sent = 0;
  for (int it = 0; it < b.iters; ++it) {
    b.pg.barrier();
    b.pg.counters().reset();
    auto t0 = std::chrono::steady_clock::now();
    attention::SavedState saved;
    st.forward(b.pg, s, in, &saved);
    auto t1 = std::chrono::steady_clock::now();
    st.backward(b.pg, s, in.mask, saved, ql.shard(x.dout, 1, b.r));
    auto t2 = std::chrono::steady_clock::now();
    tf.push_back(std::chrono::duration<double>(t1 - t0).count());
    tb.push_back(std::chrono::duration<double>(t2 - t1).count());
    sent = b.pg.counters().total_sent();
  }
  at::Tensor t = at::tensor({median(tf), median(tb), static_cast<double>(sent)}, at::kDouble);
  b.pg.all_reduce(t, dist::ReduceOp::kMax);  // the slowest rank sets the pace
  return t;
}

// Rank 0's line for one strategy: a JSON object or a table row.
void print_row(const Bench& b, const attention::AttentionSpec& s, const std::string& name,
               const at::Tensor& t, double ratio, const at::Tensor& err) {
  const double f = t[0].item<double>(), bw = t[1].item<double>(), mb = t[2].item<double>() / 1e6;
  if (b.json) {
    std::cout << nlohmann::json{{"sq", s.sq},
                                {"skv", s.skv},
                                {"hq", s.hq},
                                {"hkv", s.hkv},
                                {"head_dim", s.head_dim},
                                {"ranks", b.n},
                                {"strategy", name},
                                {"fwd_s", f},
                                {"bwd_s", bw},
                                {"speedup_vs_ring", ratio},
                                {"bytes_sent_max", t[2].item<double>()},
                                {"max_err", err.item<double>()}}
                     .dump()
              << std::endl;
  } else {
    std::printf("%6lld %7lld %3lld %3lld %4lld  %-10s %9.2f %9.2f %9s %10.2f %8.1e\n",
                (long long)s.sq, (long long)s.skv, (long long)s.hq, (long long)s.hkv,
                (long long)s.head_dim, name.c_str(), f * 1e3, bw * 1e3,
                ratio > 0 ? (std::to_string(ratio).substr(0, 4) + "x").c_str() : "-", mb,
                err.item<double>());
  }
}

// Every strategy the configuration supports, checked then timed; rank 0 prints each.
void run_config(const Bench& b, const attention::AttentionSpec& s) {
  const Inputs x = make_inputs(s);
  double ring_total = 0;
  // ring first: the baseline every ratio is against.
  for (auto kind : {attention::StrategyKind::kRing, attention::StrategyKind::kLvXAttn,
                    attention::StrategyKind::kStriped, attention::StrategyKind::kUlysses,
                    attention::StrategyKind::kAllGather}) {
    auto st = attention::make_strategy(kind);
    try {
      st->check_supported(s, b.n);
    } catch (const lvx::Error&) {
      continue;  // e.g. ulysses with heads not divisible by the ranks
    }
    const auto ql = st->q_layout(s, b.n), kl = st->kv_layout(s, b.n);
    attention::LocalInputs in{
        ql.shard(x.q, 1, b.r), kl.shard(x.k, 1, b.r), kl.shard(x.v, 1, b.r), {}};
    const at::Tensor err = max_error(b, *st, s, in, ql, x);
    const at::Tensor t = time_strategy(b, *st, s, in, ql, x);
    const double f = t[0].item<double>(), bw = t[1].item<double>();
    if (kind == attention::StrategyKind::kRing) ring_total = f + bw;
    if (b.r != 0) continue;
    print_row(b, s, st->name(), t, ring_total > 0 ? ring_total / (f + bw) : 0, err);
  }
}

int run_rank(const cli::ArgParser& p) {
  auto pg = dist::ProcessGroup::from_env();
  const Bench b{*pg, pg->world_size(), pg->rank(), p.get("output-format") == "json",
                static_cast<int>(p.get_int("iters"))};
  if (b.r == 0 && !b.json)
    std::printf("%6s %7s %3s %3s %4s  %-10s %9s %9s %9s %10s %8s\n", "Sq", "Skv", "Hq", "Hkv", "D",
                "strategy", "fwd ms", "bwd ms", "vs ring", "MB/rank", "max err");
  for (int64_t sq : p.get_int_list("sq"))
    for (int64_t skv : p.get_int_list("skv"))
      for (int64_t hq : p.get_int_list("heads"))
        for (int64_t hkv : p.get_int_list("kv-heads"))
          for (int64_t d : p.get_int_list("head-dim"))
            run_config(b, make_spec(p, sq, skv, hq, hkv, d));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  cli::ArgParser p("bench_attention [--nproc N] [--sq L] [--skv L] [--heads L] [--kv-heads L] "
                   "[--head-dim L] [--mask M] [--iters I] [-o md|json]",
                   "Every distributed attention strategy, side by side (L: comma lists).");
  p.add_option("nproc", 'n', "4", "local ranks");
  p.add_option("sq", 0, "256,1024", "query tokens");
  p.add_option("skv", 0, "16384", "key/value tokens");
  p.add_option("heads", 0, "8", "query heads");
  p.add_option("kv-heads", 0, "8", "key/value heads");
  p.add_option("head-dim", 0, "64", "head dimension");
  p.add_option("mask", 'm', "none", "none | causal | media_immediate | media_upto");
  p.add_option("iters", 0, "3", "timed repetitions (median)");
  p.add_option("output-format", 'o', "md", "md | json");
  try {
    if (!p.parse(argc, argv)) return 0;
    LVX_CHECK(p.get("mask") == "none" || p.get("mask") == "causal",
              "bench_attention generates no media metadata: use --mask none or causal");
    const int rc = dist::relaunch_self_as_ranks(static_cast<int>(p.get_int("nproc")), argc, argv);
    return rc >= 0 ? rc : run_rank(p);
  } catch (const std::exception& e) {
    std::cerr << "bench_attention: error: " << e.what() << "\n";
    return 1;
  }
}
