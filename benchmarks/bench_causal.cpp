// Causal self-attention balance and topology: on N local ranks (one run, side by side),
//   1. ring (contiguous), striped and distflash (DistFlashAttn's balanced schedule): each rank's
//      idle fraction under the unit-cost model (from the strategy's own schedule and the exact
//      visible pairs of every block it computes: idle_r = 1 − work_r / Σ_t max_r' work_r',t, the
//      quantity of DistFlashAttn's eq. (2)), and the measured forward+backward time;
//   2. the flat ring against BurstAttention's double ring over simulated nodes (--node-size):
//      bytes each rank sends across nodes, and time (one machine: every link is alike, so the
//      time shows the double ring's overhead, not its gain on a slow inter-node link).
// Correctness first: every strategy's output against single-device attention (max abs error).
//   bench_causal [--nproc 4] [--seq 4096,8192] [--heads 8] [--head-dim 64] [--node-size 2]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>

#include "src/attention/ring_pipeline.h"
#include "src/attention/strategy.h"
#include "src/cli/args.h"
#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/planner/cost_model.h"

using namespace lvx;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Idle fraction of every rank from the schedule (unit cost per visible pair, rounds in lockstep).
std::vector<double> idle_fractions(const attention::Strategy& st, const attention::AttentionSpec& s,
                                   int n) {
  planner::PairCounter pairs(planner::MaskRule::kCausal, s.sq, s.skv);
  const auto ql = st.q_layout(s, n), kl = st.kv_layout(s, n);
  std::vector<std::vector<double>> work(n);
  size_t rounds = 0;
  for (int r = 0; r < n; ++r) {
    for (const auto& b : st.schedule(s, n, r, at::kFloat, false).rounds)
      work[r].push_back(b.idle() ? 0.0 : static_cast<double>(pairs.count(ql, b.q, kl, b.kv)));
    rounds = std::max(rounds, work[r].size());
  }
  double span = 0;
  for (size_t t = 0; t < rounds; ++t) {
    double m = 0;
    for (int r = 0; r < n; ++r) m = std::max(m, t < work[r].size() ? work[r][t] : 0.0);
    span += m;
  }
  std::vector<double> idle;
  for (int r = 0; r < n; ++r) {
    double w = 0;
    for (double x : work[r]) w += x;
    idle.push_back(span > 0 ? 1 - w / span : 0);
  }
  return idle;
}

struct Timed {
  double fwd = 0, bwd = 0, err = 0;
  int64_t sent = 0, sent_inter = 0;
};

// `nodes_of`: ranks per node for counting the bytes that cross nodes (the node boundaries of the
// comparison, whatever ring s.node_size asks for).
Timed run(dist::ProcessGroup& pg, const attention::Strategy& st, const attention::AttentionSpec& s,
          const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& dout,
          int iters, int nodes_of) {
  const int n = pg.world_size(), r = pg.rank();
  const auto ql = st.q_layout(s, n), kl = st.kv_layout(s, n);
  attention::LocalInputs in{ql.shard(q, 1, r), kl.shard(k, 1, r), kl.shard(v, 1, r), {}};
  auto out = st.forward(pg, s, in, nullptr);
  auto ref = kernels::attention_forward(
      in.q, k, v, attention::block_params(s, in.mask, ql.positions(r), at::arange(s.skv)));
  at::Tensor err =
      at::full({1}, in.q.size(1) ? (out.o.to(at::kFloat) - ref.o).abs().max().item<double>() : 0.0,
               at::kDouble);
  pg.all_reduce(err, dist::ReduceOp::kMax);
  std::vector<double> tf, tb;
  Timed res;
  for (int it = 0; it < iters; ++it) {
    pg.barrier();
    pg.counters().reset();
    auto t0 = std::chrono::steady_clock::now();
    attention::SavedState saved;
    st.forward(pg, s, in, &saved);
    auto t1 = std::chrono::steady_clock::now();
    st.backward(pg, s, in.mask, saved, ql.shard(dout, 1, r));
    auto t2 = std::chrono::steady_clock::now();
    tf.push_back(std::chrono::duration<double>(t1 - t0).count());
    tb.push_back(std::chrono::duration<double>(t2 - t1).count());
    res.sent = pg.counters().total_sent();
    res.sent_inter = pg.counters().sent_inter_node(r, nodes_of);
  }
  at::Tensor t = at::tensor(
      {median(tf), median(tb), static_cast<double>(res.sent), static_cast<double>(res.sent_inter)},
      at::kDouble);
  pg.all_reduce(t, dist::ReduceOp::kMax);  // the slowest rank sets the pace
  res.fwd = t[0].item<double>();
  res.bwd = t[1].item<double>();
  res.sent = static_cast<int64_t>(t[2].item<double>());
  res.sent_inter = static_cast<int64_t>(t[3].item<double>());
  res.err = err.item<double>();
  return res;
}

int run_rank(const cli::ArgParser& p) {
  auto pg = dist::ProcessGroup::from_env();
  const int n = pg->world_size(), r = pg->rank();
  const int iters = static_cast<int>(p.get_int("iters"));
  const int64_t node_size = p.get_int("node-size");
  for (int64_t seq : p.get_int_list("seq")) {
    attention::AttentionSpec s;
    s.sq = s.skv = seq;
    s.hq = s.hkv = p.get_int("heads");
    s.head_dim = p.get_int("head-dim");
    s.mask = kernels::MaskKind::kCausal;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    auto q = at::randn({1, seq, s.hq, s.head_dim}, gen),
         k = at::randn({1, seq, s.hkv, s.head_dim}, gen);
    auto v = at::randn({1, seq, s.hkv, s.head_dim}, gen),
         dout = at::randn({1, seq, s.hq, s.head_dim}, gen);
    if (r == 0)
      std::printf(
          "\ncausal self-attention, S=%lld, H=%lld, D=%lld, %d ranks, forward+backward\n"
          "%-10s %9s %9s %9s %9s  %-24s %8s\n",
          (long long)seq, (long long)s.hq, (long long)s.head_dim, n, "strategy", "fwd ms", "bwd ms",
          "vs ring", "MB/rank", "idle fraction per rank", "max err");
    double ring_total = 0;
    for (auto kind : {attention::StrategyKind::kRing, attention::StrategyKind::kStriped,
                      attention::StrategyKind::kDistFlash}) {
      auto st = attention::make_strategy(kind);
      Timed t = run(*pg, *st, s, q, k, v, dout, iters, 0);
      if (kind == attention::StrategyKind::kRing) ring_total = t.fwd + t.bwd;
      if (r != 0) continue;
      std::string idle;
      for (double x : idle_fractions(*st, s, n)) idle += str(static_cast<int>(x * 100 + 0.5), "% ");
      std::printf("%-10s %9.1f %9.1f %8.2fx %9.2f  %-24s %8.1e\n", st->name().c_str(), t.fwd * 1e3,
                  t.bwd * 1e3, ring_total / (t.fwd + t.bwd), t.sent / 1e6, idle.c_str(), t.err);
    }
    if (!attention::double_ring(n, node_size)) continue;
    if (r == 0)
      std::printf(
          "flat ring vs double ring, %lld nodes of %lld ranks (simulated on one machine)\n"
          "%-10s %-8s %9s %9s %9s %14s %8s\n",
          (long long)(n / node_size), (long long)node_size, "strategy", "ring", "fwd ms", "bwd ms",
          "MB/rank", "MB inter-node", "max err");
    for (auto kind : {attention::StrategyKind::kRing, attention::StrategyKind::kStriped,
                      attention::StrategyKind::kLvXAttn}) {
      auto st = attention::make_strategy(kind);
      for (int64_t ns : {int64_t{0}, node_size}) {
        attention::AttentionSpec sn = s;
        sn.node_size = ns;
        Timed t = run(*pg, *st, sn, q, k, v, dout, iters, static_cast<int>(node_size));
        if (r == 0)
          std::printf("%-10s %-8s %9.1f %9.1f %9.2f %14.2f %8.1e\n", st->name().c_str(),
                      ns ? "double" : "flat", t.fwd * 1e3, t.bwd * 1e3, t.sent / 1e6,
                      t.sent_inter / 1e6, t.err);
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  cli::ArgParser p("bench_causal [--nproc N] [--seq L] [--heads H] [--head-dim D] [--node-size K]",
                   "Causal balance (ring, striped, distflash) and the double ring, side by side.");
  p.add_option("nproc", 'n', "4", "local ranks");
  p.add_option("seq", 0, "2048,8192", "tokens (queries = keys; comma list)");
  p.add_option("heads", 0, "8", "heads");
  p.add_option("head-dim", 0, "64", "head dimension");
  p.add_option("node-size", 0, "2", "ranks per simulated node for the double ring (0: skip)");
  p.add_option("iters", 0, "3", "timed repetitions (median)");
  try {
    if (!p.parse(argc, argv)) return 0;
    const int rc = dist::relaunch_self_as_ranks(static_cast<int>(p.get_int("nproc")), argc, argv);
    return rc >= 0 ? rc : run_rank(p);
  } catch (const std::exception& e) {
    std::cerr << "bench_causal: error: " << e.what() << "\n";
    return 1;
  }
}
