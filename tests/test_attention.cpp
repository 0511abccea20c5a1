// Distributed attention against single-device attention (MagiAttention's dual-reference gate):
// for every strategy × mask × {MHA, GQA} × {even, uneven shards} × world sizes 1–4, forward and
// backward, the distributed error against an fp64 reference must be at most twice the error of a
// same-dtype single-device reference plus a small atol (table below). The references are a dense
// closed form written independently of kernels/ (tests/attention_test_util.h: visibility matrix
// built from the mask rules; backward from P, dP, dS). Each rank also checks its byte counters
// against the strategy's analytic volume. Also the strategies' names, Ulysses' head check and the
// layouts' round trip; dist_attention under autograd and several calls on one strategy object
// are in test_attention_{autograd,calls}.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "src/attention/strategy.h"
#include "src/common/device_index.h"
#include "src/common/error.h"
#include "tests/attention_test_util.h"
#include "tests/multirank.h"

using namespace lvx;
using namespace lvx::attention::testing;
using attention::AttentionSpec;
using attention::LocalInputs;
using kernels::MaskKind;
using kernels::MediaRule;

namespace {

// The device the strategy suite runs its strategies on: LVX_TEST_DEVICE ("cpu" when unset;
// tests/gpu/run.sh sets "cuda", so the same cases run on a GPU against the same CPU references).
at::Device test_device() {
  const char* e = std::getenv("LVX_TEST_DEVICE");
  return resolve_device(at::Device(e != nullptr && *e != 0 ? std::string(e) : std::string("cpu")));
}

// atol per dtype: about one unit in the last place of outputs of magnitude ~1.
double atol_for(at::ScalarType t) {
  return t == at::kDouble ? 1e-12 : t == at::kFloat ? 1e-5 : 1e-2;
}

struct Case {
  std::string strategy;
  MaskKind mask;
  MediaRule rule;
  int64_t hq, hkv, sq, skv;
  at::ScalarType dtype;
  bool padded = false;    // some keys are padding (kv_valid false), differently per batch row
  bool layouts = false;   // queries striped, keys in whole blocks of 4 striped across the ranks
                          // (a model's layouts: models::media_layout)
  int node_size = 0;      // > 0: ranks per node, so that the ring strategies run the double ring
  bool sees_all = false;  // media: unmatched_sees_all (rows of media −1 see every key)
  std::string name() const {
    const char* m = mask == MaskKind::kNone         ? "none"
                    : mask == MaskKind::kCausal     ? "causal"
                    : rule == MediaRule::kImmediate ? "media_immediate"
                                                    : "media_upto";
    return lvx::str(strategy, "/", m, "/Hq", hq, "Hkv", hkv, "/Sq", sq, "Skv", skv, "/",
                    c10::toString(dtype), padded ? "/padded" : "", layouts ? "/layouts" : "",
                    node_size ? lvx::str("/nodes_of_", node_size) : std::string(),
                    sees_all ? "/sees_all" : "");
  }
};

// Per rank: largest error against fp64 seen per dtype (printed per world size), and each case's
// output and grads keyed by everything but the strategy, for the cross-strategy comparison.
std::map<std::string, double> g_max_err;
std::map<std::string, std::vector<at::Tensor>> g_first_result;

// The spec of a case: 2 samples of head size 8, the case's shapes, mask and layouts.
AttentionSpec spec_for(const Case& c) {
  AttentionSpec s;
  s.batch = 2;
  s.sq = c.sq;
  s.skv = c.skv;
  s.hq = c.hq;
  s.hkv = c.hkv;
  s.head_dim = 8;
  s.mask = c.mask;
  s.media_rule = c.rule;
  s.unmatched_sees_all = c.sees_all;
  s.node_size = c.node_size;
  if (c.layouts) {
    s.q_layout = attention::LayoutKind::kStriped;
    s.kv_layout = attention::LayoutKind::kStriped;
    s.kv_unit = 4;
  }
  return s;
}

// A case's global inputs (every rank makes them all): q, k, v, the output gradient and the mask
// metadata.
struct CaseInputs {
  at::Tensor q, k, v, dout;
  at::Tensor q_media, kv_media, kv_valid;
};

// Draws a case's inputs from a generator seeded by the case less its strategy's name.
CaseInputs make_inputs(const AttentionSpec& s, const Case& c, uint64_t seed) {
  CaseInputs x;
  // Same inputs for every strategy of a case (the cross-strategy comparison needs them).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(
      seed + std::hash<std::string>{}(c.name().substr(c.name().find('/'))) % 100000);
  x.q = at::randn({s.batch, s.sq, s.hq, s.head_dim}, gen, at::kDouble).to(c.dtype);
  x.k = at::randn({s.batch, s.skv, s.hkv, s.head_dim}, gen, at::kDouble).to(c.dtype);
  x.v = at::randn({s.batch, s.skv, s.hkv, s.head_dim}, gen, at::kDouble).to(c.dtype);
  x.dout = at::randn({s.batch, s.sq, s.hq, s.head_dim}, gen, at::kDouble).to(c.dtype);
  // Media: 3 media; keys grouped by media (some keys −1); queries' latest media, the first
  // rows before any media (−1: they see nothing).
  x.kv_media = at::div(at::arange(s.skv, at::kLong) * 3, s.skv, "floor")
                   .to(at::kInt)
                   .view({1, -1})
                   .repeat({s.batch, 1});
  x.kv_media.select(1, s.skv - 1).fill_(-1);
  x.q_media = (at::div(at::arange(s.sq, at::kLong) * 4, s.sq, "floor") - 1)
                  .to(at::kInt)
                  .view({1, -1})
                  .repeat({s.batch, 1});
  x.kv_valid = c.padded ? padding_mask(s.batch, s.skv) : at::Tensor();
  return x;
}

// This rank's results of one strategy (on the CPU) and the bytes it counted in each pass, in
// all and to each peer.
struct RankRun {
  attention::LocalOutput out;
  attention::LocalGrads grads;
  int64_t fwd_sent = 0, fwd_recv = 0, bwd_sent = 0, bwd_recv = 0;
  std::vector<int64_t> fwd_to, bwd_to;
};

// Runs the strategy's forward and backward on this rank's shards and brings the results back;
// false (said on stderr) when a result is not on the device of the inputs.
bool run_strategy(dist::ProcessGroup& pg, const attention::Strategy& strategy,
                  const AttentionSpec& s, const Case& c, const CaseInputs& x,
                  const attention::Layout& ql, const attention::Layout& kl, RankRun* run) {
  const int n = pg.world_size(), r = pg.rank();
  // The strategy runs on the test device (LVX_TEST_DEVICE; tests/gpu/run.sh sets cuda) with
  // every input of this rank there; the references stay on the CPU, and the results come back.
  const at::Device dev = test_device();
  auto on_dev = [&](const at::Tensor& t) { return t.defined() ? t.to(dev) : t; };
  LocalInputs in{on_dev(ql.shard(x.q, 1, r)),
                 on_dev(kl.shard(x.k, 1, r)),
                 on_dev(kl.shard(x.v, 1, r)),
                 {on_dev(x.q_media), on_dev(x.kv_media), on_dev(x.kv_valid)}};
  pg.counters().reset();
  attention::SavedState saved;
  run->out = strategy.forward(pg, s, in, &saved);
  run->fwd_sent = pg.counters().total_sent();
  run->fwd_recv = pg.counters().total_received();
  run->fwd_to = pg.counters().sent;
  run->grads = strategy.backward(pg, s, in.mask, saved, on_dev(ql.shard(x.dout, 1, r)));
  for (at::Tensor* t :
       {&run->out.o, &run->out.lse, &run->grads.dq, &run->grads.dk, &run->grads.dv}) {
    if (!same_device(t->device(), dev)) {
      std::cerr << "rank " << r << " " << c.name() << ": a result is on " << t->device()
                << ", the inputs on " << dev << "\n";
      return false;
    }
    *t = t->cpu();
  }
  run->bwd_to = pg.counters().sent;
  for (int j = 0; j < n; ++j) run->bwd_to[j] -= run->fwd_to[j];
  run->bwd_sent = pg.counters().total_sent() - run->fwd_sent;
  run->bwd_recv = pg.counters().total_received() - run->fwd_recv;
  return true;
}

// The dtype contract of strategy.h: o and grads in the input dtype, lse in the accumulation
// dtype. Returns the failures.
int check_dtypes(const Case& c, int r, const RankRun& run) {
  int bad = 0;
  const auto dt = c.dtype;
  for (const auto& [what, t] : std::vector<std::pair<const char*, at::Tensor>>{
           {"o", run.out.o}, {"dq", run.grads.dq}, {"dk", run.grads.dk}, {"dv", run.grads.dv}})
    if (t.scalar_type() != dt) {
      std::cerr << "rank " << r << " " << c.name() << ": " << what << " is "
                << c10::toString(t.scalar_type()) << ", the contract says the input dtype\n";
      ++bad;
    }
  if (run.out.lse.scalar_type() != kernels::accumulation_dtype(dt)) {
    std::cerr << "rank " << r << " " << c.name() << ": lse is not in the accumulation dtype\n";
    ++bad;
  }
  return bad;
}

// Rows that see no key: has_keys() says so, and o is exactly 0 there. Returns the failures.
int check_rows_without_keys(const Case& c, int r, const at::Tensor& vis,
                            const attention::Layout& ql, const RankRun& run) {
  at::Tensor sees = ql.shard(vis.any(2), 1, r);              // [B, Sq_r]
  at::Tensor got = attention::has_keys(run.out.lse).all(1);  // [B, Sq_r]
  at::Tensor zero_rows = run.out.o.to(at::kDouble).abs().amax({2, 3}).eq(0);
  if (!got.equal(sees) || !(sees.logical_not() <= zero_rows).all().item<bool>()) {
    std::cerr << "rank " << r << " " << c.name() << ": rows without keys are not marked by "
              << "has_keys(lse) or their o is not 0\n";
    return 1;
  }
  return 0;
}

// The dual-reference gate on o, lse and the grads: the error against fp64 is at most twice the
// same-dtype reference's plus atol (the largest kept in g_max_err). Returns the failures.
int gate_against_references(const Case& c, int r, const RankRun& run, const Dense& ref,
                            const Dense& same, const attention::Layout& ql,
                            const attention::Layout& kl) {
  int bad = 0;
  auto gate = [&](const char* what, const at::Tensor& got, const at::Tensor& want64,
                  const at::Tensor& want_same) {
    const double e = max_err(got, want64), e_same = max_err(want_same, want64);
    const double bound = 2 * e_same + atol_for(c.dtype);
    auto& m = g_max_err[lvx::str(c10::toString(c.dtype), " ", what)];
    m = std::max(m, e);
    if (!(e <= bound)) {
      std::cerr << "rank " << r << " " << c.name() << " " << what << ": error " << e << " > bound "
                << bound << " (same-dtype reference error " << e_same << ")\n";
      ++bad;
    }
  };
  const auto dt = c.dtype;
  const auto& out = run.out;
  const auto& grads = run.grads;
  gate("o", out.o.to(dt), ql.shard(ref.o, 1, r), ql.shard(same.o, 1, r));
  gate("lse", out.lse, ql.shard(ref.lse, 2, r), ql.shard(same.lse.to(at::kFloat), 2, r));
  gate("dq", grads.dq.to(dt), ql.shard(ref.dq, 1, r), ql.shard(same.dq, 1, r));
  gate("dk", grads.dk.to(dt), kl.shard(ref.dk, 1, r), kl.shard(same.dk, 1, r));
  gate("dv", grads.dv.to(dt), kl.shard(ref.dv, 1, r), kl.shard(same.dv, 1, r));
  return bad;
}

// o, dq, dk and dv of every rank gathered to global order, each through its strategy's layout.
std::vector<at::Tensor> gather_results(dist::ProcessGroup& pg, const Case& c, const RankRun& run,
                                       const attention::Layout& ql, const attention::Layout& kl) {
  const int n = pg.world_size();
  const auto dt = c.dtype;
  std::vector<at::Tensor> mine;
  for (const auto& [t, layout, dim] :
       std::vector<std::tuple<at::Tensor, attention::Layout, int>>{{run.out.o.to(dt), ql, 1},
                                                                   {run.grads.dq.to(dt), ql, 1},
                                                                   {run.grads.dk.to(dt), kl, 1},
                                                                   {run.grads.dv.to(dt), kl, 1}}) {
    std::vector<int64_t> sizes = layout.sizes();
    at::Tensor rows = t.transpose(0, 1).contiguous();
    at::Tensor all = pg.all_gather(rows, sizes).transpose(0, 1);
    std::vector<at::Tensor> shards;
    int64_t off = 0;
    for (int j = 0; j < n; ++j) {
      shards.push_back(all.narrow(1, off, sizes[j]));
      off += sizes[j];
    }
    mine.push_back(layout.unshard(shards, 1));
  }
  return mine;
}

// Cross-strategy equivalence: every strategy's result (gathered to global order through its own
// layout) is within twice the gate of the first strategy's on the same inputs. Returns the
// failures.
int check_cross_strategy(dist::ProcessGroup& pg, const Case& c, const RankRun& run,
                         const Dense& ref, const Dense& same, const attention::Layout& ql,
                         const attention::Layout& kl) {
  const int r = pg.rank();
  int bad = 0;
  std::vector<at::Tensor> mine = gather_results(pg, c, run, ql, kl);
  const std::string key = c.name().substr(c.name().find('/'));
  auto it = g_first_result.find(key);
  if (it == g_first_result.end()) {
    g_first_result[key] = mine;
  } else {
    const double limit = 2 * (2 * max_err(same.o, ref.o) + atol_for(c.dtype)) +
                         2 * (2 * std::max({max_err(same.dq, ref.dq), max_err(same.dk, ref.dk),
                                            max_err(same.dv, ref.dv)}) +
                              atol_for(c.dtype));
    for (size_t i = 0; i < mine.size(); ++i) {
      const double e = max_err(mine[i], it->second[i]);
      if (!(e <= limit)) {
        std::cerr << "rank " << r << " " << c.name() << ": differs from the first strategy by " << e
                  << " (limit " << limit << ") in output " << i << "\n";
        ++bad;
      }
    }
  }
  return bad;
}

// The bytes counted in each pass against the strategy's analytic volume. Returns the failures.
int check_bytes(dist::ProcessGroup& pg, const attention::Strategy& strategy, const AttentionSpec& s,
                const Case& c, const RankRun& run) {
  const int n = pg.world_size(), r = pg.rank();
  pg.counters().reset();
  auto vf = strategy.analytic_bytes(s, n, r, c.dtype, false);
  auto vb = strategy.analytic_bytes(s, n, r, c.dtype, true);
  if (vf.sent != run.fwd_sent || vf.received != run.fwd_recv || vb.sent != run.bwd_sent ||
      vb.received != run.bwd_recv) {
    std::cerr << "rank " << r << " " << c.name() << ": bytes fwd " << run.fwd_sent << "/"
              << run.fwd_recv << " (analytic " << vf.sent << "/" << vf.received << "), bwd "
              << run.bwd_sent << "/" << run.bwd_recv << " (analytic " << vb.sent << "/"
              << vb.received << ")\n";
    return 1;
  }
  return 0;
}

// Point-to-point schedules name each message's peer: the bytes sent to every peer must match
// (the double ring's inter-node hops, distflash's distance-t messages). Returns the failures.
int check_bytes_per_peer(const attention::Strategy& strategy, const AttentionSpec& s, const Case& c,
                         int n, int r, const RankRun& run) {
  int bad = 0;
  for (bool backward : {false, true}) {
    const auto sched = strategy.schedule(s, n, r, c.dtype, backward);
    std::vector<int64_t> want(n, 0);
    bool p2p = true;
    for (const auto& m : sched.messages) {
      if (m.peer < 0)
        p2p = false;
      else
        want[m.peer] += m.sent;
    }
    if (p2p && want != (backward ? run.bwd_to : run.fwd_to)) {
      std::cerr << "rank " << r << " " << c.name() << ": bytes per peer differ from the "
                << (backward ? "backward" : "forward") << " schedule's\n";
      ++bad;
    }
  }
  return bad;
}

// One case on this rank: the strategy against the references, then its bytes. Returns the
// failures.
int run_case(dist::ProcessGroup& pg, const Case& c, uint64_t seed) {
  const int n = pg.world_size(), r = pg.rank();
  const AttentionSpec s = spec_for(c);
  const CaseInputs x = make_inputs(s, c, seed);
  auto strategy = attention::make_strategy(attention::strategy_from_name(c.strategy));
  auto vis = visibility(s, x.q_media, x.kv_media);
  if (c.padded) vis = vis & x.kv_valid.unsqueeze(1);
  Dense ref = dense(s, x.q, x.k, x.v, x.dout, vis, at::kDouble);
  Dense same = dense(s, x.q, x.k, x.v, x.dout, vis, c.dtype);

  const auto ql = strategy->q_layout(s, n), kl = strategy->kv_layout(s, n);
  RankRun run;
  if (!run_strategy(pg, *strategy, s, c, x, ql, kl, &run)) return 1;
  int bad = check_dtypes(c, r, run);
  bad += check_rows_without_keys(c, r, vis, ql, run);
  bad += gate_against_references(c, r, run, ref, same, ql, kl);
  bad += check_cross_strategy(pg, c, run, ref, same, ql, kl);
  bad += check_bytes(pg, *strategy, s, c, run);
  bad += check_bytes_per_peer(*strategy, s, c, n, r, run);
  return bad;
}

std::vector<Case> all_cases(int world) {
  std::vector<Case> cases;
  const std::vector<std::tuple<MaskKind, MediaRule>> masks = {
      {MaskKind::kNone, MediaRule::kImmediate},
      {MaskKind::kCausal, MediaRule::kImmediate},
      {MaskKind::kMedia, MediaRule::kImmediate},
      {MaskKind::kMedia, MediaRule::kUpTo}};
  // (sq, skv): even; uneven; causal Sq != Skv; decoding Sq = 1 (< world); Skv ≫ Sq.
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {int64_t{12} * world, int64_t{16} * world}, {13, 19}, {1, 11}, {5, 97}};
  for (const auto& strat : {"ring", "lv_xattn", "striped", "ulysses", "all_gather"})
    for (auto [mask, rule] : masks)
      for (auto [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {4, 2}})
        for (auto [sq, skv] : shapes) {
          if (std::string(strat) == "ulysses" && (hq % world || hkv % world)) continue;
          for (auto dt : {at::kFloat, at::kBFloat16})
            cases.push_back({strat, mask, rule, hq, hkv, sq, skv, dt});
          if (sq == 13) cases.push_back({strat, mask, rule, hq, hkv, sq, skv, at::kFloat, true});
          if (sq == 13)  // 20 keys: 5 blocks of 4
            cases.push_back({strat, mask, rule, hq, hkv, sq, 20, at::kFloat, false, true});
          // Two nodes of two ranks: the double ring (ring strategies; the others ignore it).
          if (world == 4 && sq != 1)
            cases.push_back({strat, mask, rule, hq, hkv, sq, skv, at::kFloat, sq == 13, false, 2});
          // Llama-3.2-Vision's media masks (models/mllama/mask.h): rows that see no media see
          // every key (padding excluded), also with a model's layouts (keys in blocks of 4).
          if (mask == MaskKind::kMedia) {
            Case a{strat, mask, rule, hq, hkv, sq, skv, at::kFloat, sq == 13};
            a.sees_all = true;
            cases.push_back(a);
            if (sq == 13) {
              Case l{strat, mask, rule, hq, hkv, sq, 20, at::kFloat, true, true};
              l.sees_all = true;
              cases.push_back(l);
            }
          }
        }
  // Causal self-attention (Sq = Skv), where distflash balances the work: even, uneven, and fewer
  // tokens than ranks, against ring and striped on the same inputs.
  for (const auto& strat : {"ring", "striped", "distflash"})
    for (auto [hq, hkv] : std::vector<std::pair<int64_t, int64_t>>{{4, 4}, {4, 2}})
      for (int64_t len : {int64_t{12} * world, int64_t{13}, int64_t{3}}) {
        for (auto dt : {at::kFloat, at::kBFloat16})
          cases.push_back({strat, MaskKind::kCausal, MediaRule::kImmediate, hq, hkv, len, len, dt});
        if (len == 13)
          cases.push_back({strat, MaskKind::kCausal, MediaRule::kImmediate, hq, hkv, len, len,
                           at::kFloat, true});
      }
  return cases;
}

}  // namespace

LVX_WORKER(strategies) {
  auto pg = dist::ProcessGroup::from_env();
  const auto cases = all_cases(pg->world_size());
  pg->check_agreement("cases", std::to_string(cases.size()));
  int bad = 0;
  for (const auto& c : cases) bad += run_case(*pg, c, 1);
  std::cout << "rank " << pg->rank() << " of " << pg->world_size() << ": " << cases.size()
            << " cases, " << bad << " failures; largest error vs fp64:";
  for (const auto& [k, e] : g_max_err) std::cout << " " << k << "=" << e;
  std::cout << "\n";
  return bad ? 1 : 0;
}

class Strategies : public ::testing::TestWithParam<int> {};

TEST_P(Strategies, AgreeWithSingleDeviceForwardBackwardAndBytes) {
  lvx::testing::expect_all_ok(lvx::testing::run_ranks(GetParam(), "strategies", 500));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, Strategies, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "world" + std::to_string(info.param); });

LVX_WORKER(ulysses_refuses) {
  auto pg = dist::ProcessGroup::from_env();
  AttentionSpec s;
  s.sq = s.skv = 8;
  s.hq = 4;
  s.hkv = 1;
  s.head_dim = 8;
  try {
    attention::make_strategy(attention::StrategyKind::kUlysses)
        ->check_supported(s, pg->world_size());
  } catch (const lvx::Error& e) {
    std::cout << e.what() << "\n";
    return std::string(e.what()).find("must both divide by the 2 ranks") != std::string::npos ? 0
                                                                                              : 1;
  }
  return 1;
}

TEST(Strategies, UlyssesRefusesHeadsThatDoNotDivide) {
  lvx::testing::expect_all_ok(lvx::testing::run_ranks(2, "ulysses_refuses", 60));
}

TEST(Strategies, NamesRoundTripAndUnknownIsClear) {
  for (auto k : attention::all_strategies())
    EXPECT_EQ(attention::strategy_from_name(attention::strategy_name(k)), k);
  try {
    attention::strategy_from_name("rign");
    FAIL();
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("valid: lv_xattn, ring"), std::string::npos);
  }
}

TEST(Layouts, ShardUnshardRoundTripEvenUnevenStriped) {
  for (auto kind : {attention::LayoutKind::kContiguous, attention::LayoutKind::kStriped})
    for (int world : {1, 2, 3, 4})
      for (int64_t total : {1, 5, 12, 13, 20}) {
        attention::Layout l{kind, total, world, total % 4 == 0 ? 4 : 1};
        auto x = at::arange(total, at::kLong).view({1, -1});
        std::vector<at::Tensor> shards;
        int64_t sum = 0;
        for (int r = 0; r < world; ++r) {
          shards.push_back(l.shard(x, 1, r));
          sum += l.local_size(r);
          EXPECT_TRUE(shards.back().view({-1}).equal(l.positions(r)));
        }
        EXPECT_EQ(sum, total);
        EXPECT_TRUE(l.unshard(shards, 1).equal(x));
      }
}
