// Distributed attention against single-device attention (MagiAttention's dual-reference gate):
// for every strategy × mask × {MHA, GQA} × {even, uneven shards} × world sizes 1–4, forward and
// backward, the distributed error against an fp64 reference must be at most twice the error of a
// same-dtype single-device reference plus a small atol (table below). The references here are a
// dense closed form written independently of kernels/ (visibility matrix built from the mask
// rules; backward from P, dP, dS). Each rank also checks its byte counters against the
// strategy's analytic volume.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <iostream>

#include "src/attention/strategy.h"
#include "src/common/device_index.h"
#include "src/common/error.h"
#include "tests/multirank.h"

using namespace lvx;
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

struct Dense {
  at::Tensor o, lse, dq, dk, dv;
};

// visible[b, i, j]: query i sees key j, straight from the mask rules of kernels/attention.h.
// With unmatched_sees_all, a query of media −1 sees every key (padding is removed by the caller).
at::Tensor visibility(const AttentionSpec& s, const at::Tensor& q_media, const at::Tensor& kv_media) {
  if (s.mask == MaskKind::kNone) return at::ones({s.batch, s.sq, s.skv}, at::kBool);
  if (s.mask == MaskKind::kCausal) {
    auto qp = at::arange(s.sq, at::kLong).view({1, -1, 1}) + (s.skv - s.sq);
    auto kp = at::arange(s.skv, at::kLong).view({1, 1, -1});
    return kp.le(qp).expand({s.batch, s.sq, s.skv}).clone();
  }
  auto qm = q_media.to(at::kLong).unsqueeze(2), km = kv_media.to(at::kLong).unsqueeze(1);
  auto seen = s.media_rule == MediaRule::kImmediate ? km.eq(qm) : km.le(qm);
  seen = seen & qm.ge(0) & km.ge(0);
  if (s.unmatched_sees_all) seen = seen | qm.lt(0).expand_as(seen);
  return seen;
}

// Dense attention and its gradient in `dt` (float64 = exact reference).
Dense dense(const AttentionSpec& s, at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor dout,
            const at::Tensor& vis, at::ScalarType dt) {
  const int64_t g = s.hq / s.hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  q = q.to(dt).permute({0, 2, 1, 3});  // [B, H, S, D]
  k = k.to(dt).repeat_interleave(g, 2).permute({0, 2, 1, 3});
  v = v.to(dt).repeat_interleave(g, 2).permute({0, 2, 1, 3});
  dout = dout.to(dt).permute({0, 2, 1, 3});
  auto m = vis.unsqueeze(1);  // [B, 1, Sq, Skv]
  auto S = at::matmul(q, k.transpose(-1, -2)) * scale;
  S = S.masked_fill(m.logical_not(), -INFINITY);
  auto lse = at::logsumexp(S, -1);  // −inf for empty rows
  auto P = at::exp(S - lse.unsqueeze(-1)).nan_to_num(0.0).masked_fill(m.logical_not(), 0.0);
  auto O = at::matmul(P, v);
  auto dV = at::matmul(P.transpose(-1, -2), dout);
  auto dP = at::matmul(dout, v.transpose(-1, -2));
  auto D = (dout * O).sum(-1, true);
  auto dS = P * (dP - D);
  auto dQ = at::matmul(dS, k) * scale;
  auto dK = at::matmul(dS.transpose(-1, -2), q) * scale;
  auto fold = [&](const at::Tensor& x) {  // [B, Hq, S, D] → [B, S, Hkv, D], summed per group
    return x.view({s.batch, s.hkv, g, x.size(2), s.head_dim}).sum(2).permute({0, 2, 1, 3});
  };
  return {O.permute({0, 2, 1, 3}), lse, dQ.permute({0, 2, 1, 3}), fold(dK), fold(dV)};
}

double max_err(const at::Tensor& a, const at::Tensor& ref) {
  auto d = (a.to(at::kDouble) - ref.to(at::kDouble)).abs();
  // −inf lse rows must match exactly; compare them as 0 error only if both are −inf.
  auto both_inf = a.to(at::kDouble).isinf() & ref.isinf() & a.to(at::kDouble).eq(ref);
  d = d.masked_fill(both_inf, 0.0);
  if (d.numel() == 0) return 0;
  return d.isnan().any().item<bool>() ? INFINITY : d.max().item<double>();
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
  bool padded = false;  // some keys are padding (kv_valid false), differently per batch row
  bool layouts = false;  // queries striped, keys in whole blocks of 4 striped across the ranks
                         // (a model's layouts: models::media_layout)
  int node_size = 0;     // > 0: ranks per node, so that the ring strategies run the double ring
  bool sees_all = false;  // media: unmatched_sees_all (rows of media −1 see every key)
  std::string name() const {
    const char* m = mask == MaskKind::kNone ? "none" : mask == MaskKind::kCausal ? "causal"
                    : rule == MediaRule::kImmediate ? "media_immediate" : "media_upto";
    return lvx::str(strategy, "/", m, "/Hq", hq, "Hkv", hkv, "/Sq", sq, "Skv", skv, "/",
                    c10::toString(dtype), padded ? "/padded" : "", layouts ? "/layouts" : "",
                    node_size ? lvx::str("/nodes_of_", node_size) : std::string(),
                    sees_all ? "/sees_all" : "");
  }
};

// Padding: batch row b has its last 3·(b+1) keys invalid (capped below Skv), and in row 1 also
// the first key, so that whole ranks' key shards can be padding.
at::Tensor padding_mask(int64_t batch, int64_t skv) {
  auto valid = at::ones({batch, skv}, at::kBool);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t pad = std::min<int64_t>(3 * (b + 1), skv - 1);
    valid[b].narrow(0, skv - pad, pad).fill_(false);
    if (b == 1) valid[b][0] = false;
  }
  return valid;
}

// Per rank: largest error against fp64 seen per dtype (printed per world size), and each case's
// output and grads keyed by everything but the strategy, for the cross-strategy comparison.
std::map<std::string, double> g_max_err;
std::map<std::string, std::vector<at::Tensor>> g_first_result;

int run_case(dist::ProcessGroup& pg, const Case& c, uint64_t seed) {
  const int n = pg.world_size(), r = pg.rank();
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
  // Same inputs for every strategy of a case (the cross-strategy comparison needs them).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(
      seed + std::hash<std::string>{}(c.name().substr(c.name().find('/'))) % 100000);
  auto q = at::randn({s.batch, s.sq, s.hq, s.head_dim}, gen, at::kDouble).to(c.dtype);
  auto k = at::randn({s.batch, s.skv, s.hkv, s.head_dim}, gen, at::kDouble).to(c.dtype);
  auto v = at::randn({s.batch, s.skv, s.hkv, s.head_dim}, gen, at::kDouble).to(c.dtype);
  auto dout = at::randn({s.batch, s.sq, s.hq, s.head_dim}, gen, at::kDouble).to(c.dtype);
  // Media: 3 media; keys grouped by media (some keys −1); queries' latest media, the first
  // rows before any media (−1: they see nothing).
  auto kv_media = at::div(at::arange(s.skv, at::kLong) * 3, s.skv, "floor").to(at::kInt).view({1, -1}).repeat({s.batch, 1});
  kv_media.select(1, s.skv - 1).fill_(-1);
  auto q_media = (at::div(at::arange(s.sq, at::kLong) * 4, s.sq, "floor") - 1).to(at::kInt).view({1, -1}).repeat({s.batch, 1});
  auto strategy = attention::make_strategy(attention::strategy_from_name(c.strategy));
  at::Tensor kv_valid = c.padded ? padding_mask(s.batch, s.skv) : at::Tensor();
  auto vis = visibility(s, q_media, kv_media);
  if (c.padded) vis = vis & kv_valid.unsqueeze(1);
  Dense ref = dense(s, q, k, v, dout, vis, at::kDouble);
  Dense same = dense(s, q, k, v, dout, vis, c.dtype);

  const auto ql = strategy->q_layout(s, n), kl = strategy->kv_layout(s, n);
  // The strategy runs on the test device (LVX_TEST_DEVICE; tests/gpu/run.sh sets cuda) with
  // every input of this rank there; the references stay on the CPU, and the results come back.
  const at::Device dev = test_device();
  auto on_dev = [&](const at::Tensor& t) { return t.defined() ? t.to(dev) : t; };
  LocalInputs in{on_dev(ql.shard(q, 1, r)), on_dev(kl.shard(k, 1, r)), on_dev(kl.shard(v, 1, r)),
                 {on_dev(q_media), on_dev(kv_media), on_dev(kv_valid)}};
  pg.counters().reset();
  attention::SavedState saved;
  auto out = strategy->forward(pg, s, in, &saved);
  auto fwd_sent = pg.counters().total_sent(), fwd_recv = pg.counters().total_received();
  const std::vector<int64_t> fwd_to = pg.counters().sent;
  auto grads = strategy->backward(pg, s, in.mask, saved, on_dev(ql.shard(dout, 1, r)));
  for (at::Tensor* t : {&out.o, &out.lse, &grads.dq, &grads.dk, &grads.dv}) {
    if (!same_device(t->device(), dev)) {
      std::cerr << "rank " << r << " " << c.name() << ": a result is on " << t->device()
                << ", the inputs on " << dev << "\n";
      return 1;
    }
    *t = t->cpu();
  }
  std::vector<int64_t> bwd_to = pg.counters().sent;
  for (int j = 0; j < n; ++j) bwd_to[j] -= fwd_to[j];
  auto bwd_sent = pg.counters().total_sent() - fwd_sent;
  auto bwd_recv = pg.counters().total_received() - fwd_recv;

  int bad = 0;
  auto gate = [&](const char* what, const at::Tensor& got, const at::Tensor& want64,
                  const at::Tensor& want_same) {
    const double e = max_err(got, want64), e_same = max_err(want_same, want64);
    const double bound = 2 * e_same + atol_for(c.dtype);
    auto& m = g_max_err[lvx::str(c10::toString(c.dtype), " ", what)];
    m = std::max(m, e);
    if (!(e <= bound)) {
      std::cerr << "rank " << r << " " << c.name() << " " << what << ": error " << e
                << " > bound " << bound << " (same-dtype reference error " << e_same << ")\n";
      ++bad;
    }
  };
  // The dtype contract of strategy.h: o and grads in the input dtype, lse in the accumulation
  // dtype.
  const auto dt = c.dtype;
  for (const auto& [what, t] : std::vector<std::pair<const char*, at::Tensor>>{
           {"o", out.o}, {"dq", grads.dq}, {"dk", grads.dk}, {"dv", grads.dv}})
    if (t.scalar_type() != dt) {
      std::cerr << "rank " << r << " " << c.name() << ": " << what << " is "
                << c10::toString(t.scalar_type()) << ", the contract says the input dtype\n";
      ++bad;
    }
  if (out.lse.scalar_type() != kernels::accumulation_dtype(dt)) {
    std::cerr << "rank " << r << " " << c.name() << ": lse is not in the accumulation dtype\n";
    ++bad;
  }
  // Rows that see no key: has_keys() says so, and o is exactly 0 there.
  {
    at::Tensor sees = ql.shard(vis.any(2), 1, r);                     // [B, Sq_r]
    at::Tensor got = attention::has_keys(out.lse).all(1);             // [B, Sq_r]
    at::Tensor zero_rows = out.o.to(at::kDouble).abs().amax({2, 3}).eq(0);
    if (!got.equal(sees) || !(sees.logical_not() <= zero_rows).all().item<bool>()) {
      std::cerr << "rank " << r << " " << c.name() << ": rows without keys are not marked by "
                << "has_keys(lse) or their o is not 0\n";
      ++bad;
    }
  }
  gate("o", out.o.to(dt), ql.shard(ref.o, 1, r), ql.shard(same.o, 1, r));
  gate("lse", out.lse, ql.shard(ref.lse, 2, r), ql.shard(same.lse.to(at::kFloat), 2, r));
  gate("dq", grads.dq.to(dt), ql.shard(ref.dq, 1, r), ql.shard(same.dq, 1, r));
  gate("dk", grads.dk.to(dt), kl.shard(ref.dk, 1, r), kl.shard(same.dk, 1, r));
  gate("dv", grads.dv.to(dt), kl.shard(ref.dv, 1, r), kl.shard(same.dv, 1, r));
  // Cross-strategy equivalence: every strategy's result (gathered to global order through its own
  // layout) is within twice the gate of the first strategy's on the same inputs.
  {
    std::vector<at::Tensor> mine;
    for (const auto& [t, layout, dim] : std::vector<std::tuple<at::Tensor, attention::Layout, int>>{
             {out.o.to(dt), ql, 1}, {grads.dq.to(dt), ql, 1}, {grads.dk.to(dt), kl, 1},
             {grads.dv.to(dt), kl, 1}}) {
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
    const std::string key = c.name().substr(c.name().find('/'));
    auto it = g_first_result.find(key);
    if (it == g_first_result.end()) {
      g_first_result[key] = mine;
    } else {
      const double limit = 2 * (2 * max_err(same.o, ref.o) + atol_for(c.dtype)) +
                           2 * (2 * std::max({max_err(same.dq, ref.dq), max_err(same.dk, ref.dk),
                                              max_err(same.dv, ref.dv)}) + atol_for(c.dtype));
      for (size_t i = 0; i < mine.size(); ++i) {
        const double e = max_err(mine[i], it->second[i]);
        if (!(e <= limit)) {
          std::cerr << "rank " << r << " " << c.name() << ": differs from the first strategy by "
                    << e << " (limit " << limit << ") in output " << i << "\n";
          ++bad;
        }
      }
    }
  }
  pg.counters().reset();
  auto vf = strategy->analytic_bytes(s, n, r, c.dtype, false);
  auto vb = strategy->analytic_bytes(s, n, r, c.dtype, true);
  if (vf.sent != fwd_sent || vf.received != fwd_recv || vb.sent != bwd_sent ||
      vb.received != bwd_recv) {
    std::cerr << "rank " << r << " " << c.name() << ": bytes fwd " << fwd_sent << "/" << fwd_recv
              << " (analytic " << vf.sent << "/" << vf.received << "), bwd " << bwd_sent << "/"
              << bwd_recv << " (analytic " << vb.sent << "/" << vb.received << ")\n";
    ++bad;
  }
  // Point-to-point schedules name each message's peer: the bytes sent to every peer must match
  // (the double ring's inter-node hops, distflash's distance-t messages).
  for (bool backward : {false, true}) {
    const auto sched = strategy->schedule(s, n, r, c.dtype, backward);
    std::vector<int64_t> want(n, 0);
    bool p2p = true;
    for (const auto& m : sched.messages) {
      if (m.peer < 0) p2p = false;
      else want[m.peer] += m.sent;
    }
    if (p2p && want != (backward ? bwd_to : fwd_to)) {
      std::cerr << "rank " << r << " " << c.name() << ": bytes per peer differ from the "
                << (backward ? "backward" : "forward") << " schedule's\n";
      ++bad;
    }
  }
  return bad;
}

std::vector<Case> all_cases(int world) {
  std::vector<Case> cases;
  const std::vector<std::tuple<MaskKind, MediaRule>> masks = {
      {MaskKind::kNone, MediaRule::kImmediate}, {MaskKind::kCausal, MediaRule::kImmediate},
      {MaskKind::kMedia, MediaRule::kImmediate}, {MaskKind::kMedia, MediaRule::kUpTo}};
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
    attention::make_strategy(attention::StrategyKind::kUlysses)->check_supported(s, pg->world_size());
  } catch (const lvx::Error& e) {
    std::cout << e.what() << "\n";
    return std::string(e.what()).find("must both divide by the 2 ranks") != std::string::npos ? 0 : 1;
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

// ---- autograd ----------------------------------------------------------------------------

#include "src/attention/dist_attention.h"

// The strategy as an autograd function inside a graph (an upstream op scales q by 2, the loss
// uses o and lse, keys are padded): the leaf gradients equal those of an fp64 dense attention
// differentiated by autograd, shard by shard.
LVX_WORKER(autograd) {
  auto pg = std::shared_ptr<dist::ProcessGroup>(dist::ProcessGroup::from_env());
  const int n = pg->world_size(), r = pg->rank();
  int bad = 0;
  for (const char* name : {"lv_xattn", "ring", "striped", "ulysses", "all_gather", "distflash"}) {
    AttentionSpec s;
    s.batch = 1;
    s.sq = 7;
    s.skv = std::string(name) == "distflash" ? 7 : 10;  // distflash: causal self-attention
    s.hq = 4;
    s.hkv = 2;
    s.head_dim = 8;
    s.mask = MaskKind::kCausal;
    auto kind = attention::strategy_from_name(name);
    auto strategy = attention::make_strategy(kind);
    if (kind == attention::StrategyKind::kUlysses && s.hkv % n) continue;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
    auto q = at::randn({1, s.sq, s.hq, s.head_dim}, gen, at::kDouble);
    auto k = at::randn({1, s.skv, s.hkv, s.head_dim}, gen, at::kDouble);
    auto v = at::randn({1, s.skv, s.hkv, s.head_dim}, gen, at::kDouble);
    auto dout = at::randn({1, s.sq, s.hq, s.head_dim}, gen, at::kDouble);
    // Padding reaches the kernels through dist_attention's mask inputs.
    at::Tensor kv_valid = padding_mask(1, s.skv);
    at::Tensor vis = visibility(s, {}, {}) & kv_valid.unsqueeze(1);
    // The loss also uses lse (as a merge of partial results by lse does): its gradient must flow.
    auto dl = at::randn({1, s.hq, s.sq}, gen, at::kDouble);
    // Reference: dense attention in fp64, differentiated by autograd.
    auto qr = (q * 2).detach().requires_grad_(), kr = k.detach().requires_grad_(),
         vr = v.detach().requires_grad_();
    {
      const int64_t g = s.hq / s.hkv;
      auto S = at::matmul(qr.permute({0, 2, 1, 3}),
                          kr.repeat_interleave(g, 2).permute({0, 2, 3, 1})) /
               std::sqrt(double(s.head_dim));
      S = S.masked_fill(vis.unsqueeze(1).logical_not(), -INFINITY);
      auto lse = at::logsumexp(S, -1);  // [B, H, Sq]
      auto P = at::softmax(S, -1);
      auto O = at::matmul(P, vr.repeat_interleave(g, 2).permute({0, 2, 1, 3})).permute({0, 2, 1, 3});
      ((O * dout).sum() + (lse * dl).sum()).backward();
    }
    const auto ql = strategy->q_layout(s, n), kl = strategy->kv_layout(s, n);
    auto q_leaf = ql.shard(q, 1, r).requires_grad_();
    auto k_leaf = kl.shard(k, 1, r).requires_grad_();
    auto v_leaf = kl.shard(v, 1, r).requires_grad_();
    auto res = attention::dist_attention(q_leaf * 2, k_leaf, v_leaf, pg, kind, s,
                                         {{}, {}, kv_valid});
    ((res.o * ql.shard(dout, 1, r)).sum() + (res.lse.to(at::kDouble) * ql.shard(dl, 2, r)).sum())
        .backward();
    const double e_q = max_err(q_leaf.grad(), ql.shard(qr.grad(), 1, r) * 2);
    const double e_k = max_err(k_leaf.grad(), kl.shard(kr.grad(), 1, r));
    const double e_v = max_err(v_leaf.grad(), kl.shard(vr.grad(), 1, r));
    if (!(std::max({e_q, e_k, e_v}) < 1e-10)) {
      std::cerr << "rank " << r << " " << name << ": autograd errors dq " << e_q << " dk " << e_k
                << " dv " << e_v << "\n";
      ++bad;
    }
  }
  return bad;
}

// Ranks told by the launcher that they share nodes (LOCAL_WORLD_SIZE=2 of 4) run the double
// ring through dist_attention without being asked: each rank sends to the same local rank of
// the other node exactly the schedule's inter-node bytes (one K/V block per pass, plus the
// backward's node-partial dK/dV twice), and the gradients match the fp64 reference.
LVX_WORKER(double_ring_from_launcher) {
  auto pg = std::shared_ptr<dist::ProcessGroup>(dist::ProcessGroup::from_env());
  const int n = pg->world_size(), r = pg->rank();
  if (pg->info().local_world_size != 2 || n != 4) return 2;
  AttentionSpec s;
  s.batch = 1;
  s.sq = s.skv = 16;
  s.hq = s.hkv = 2;
  s.head_dim = 8;
  s.mask = MaskKind::kCausal;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto q = at::randn({1, 16, 2, 8}, gen, at::kDouble), k = at::randn({1, 16, 2, 8}, gen, at::kDouble);
  auto v = at::randn({1, 16, 2, 8}, gen, at::kDouble), dout = at::randn({1, 16, 2, 8}, gen, at::kDouble);
  const auto ring = attention::make_strategy(attention::StrategyKind::kRing);
  const auto l = ring->q_layout(s, n);
  auto q_leaf = l.shard(q, 1, r).requires_grad_(), k_leaf = l.shard(k, 1, r).requires_grad_();
  auto v_leaf = l.shard(v, 1, r).requires_grad_();
  pg->counters().reset();
  auto res = attention::dist_attention(q_leaf, k_leaf, v_leaf, pg, attention::StrategyKind::kRing, s);
  (res.o * l.shard(dout, 1, r)).sum().backward();
  const int other_node = (r + 2) % 4;
  AttentionSpec sn = s;
  sn.node_size = 2;
  int64_t want = 0;
  for (bool bwd : {false, true})
    for (const auto& m : ring->schedule(sn, n, r, at::kDouble, bwd).messages)
      if (m.peer == other_node) want += m.sent;
  int bad = 0;
  if (pg->counters().sent[other_node] != want || want == 0 ||
      pg->counters().sent_inter_node(r, 2) != want) {
    std::cerr << "rank " << r << ": sent " << pg->counters().sent[other_node] << " B to rank "
              << other_node << ", the double ring's schedule says " << want << "\n";
    ++bad;
  }
  Dense ref = dense(s, q, k, v, dout, visibility(s, {}, {}), at::kDouble);
  const double e = std::max({max_err(res.o, l.shard(ref.o, 1, r)), max_err(q_leaf.grad(), l.shard(ref.dq, 1, r)),
                             max_err(k_leaf.grad(), l.shard(ref.dk, 1, r)),
                             max_err(v_leaf.grad(), l.shard(ref.dv, 1, r))});
  if (!(e < 1e-10)) {
    std::cerr << "rank " << r << ": double ring error " << e << "\n";
    ++bad;
  }
  return bad;
}

TEST(Strategies, DoubleRingFollowsTheLaunchersNodes) {
  lvx::testing::expect_all_ok(lvx::testing::run_ranks(
      4, "double_ring_from_launcher", 120, {{"LOCAL_WORLD_SIZE", "2"}}));
}

TEST(Autograd, EveryStrategyIsDifferentiableInAGraph) {
  for (int world : {1, 2, 3})
    lvx::testing::expect_all_ok(lvx::testing::run_ranks(world, "autograd", 120));
}

// Several calls on one strategy object, as a model's layers make them: three forwards (different
// shapes and masks), then the backwards in reverse order, equal bit for bit to each call run
// alone. A strategy that kept forward state on the object would mix the calls up. Also run for
// the pairs a plan may choose (forward of one strategy, backward of another).
LVX_WORKER(interleaved) {
  auto pg = dist::ProcessGroup::from_env();
  const int n = pg->world_size(), r = pg->rank();
  struct Call {
    AttentionSpec s;
    LocalInputs in;
    at::Tensor dout;
  };
  auto make_call = [&](const attention::Strategy& st, int64_t sq, int64_t skv, MaskKind mask,
                       uint64_t seed) {
    Call c;
    c.s.batch = 2;
    c.s.sq = sq;
    c.s.skv = skv;
    c.s.hq = 4;
    c.s.hkv = 2;
    c.s.head_dim = 8;
    c.s.mask = mask;
    c.s.media_rule = MediaRule::kUpTo;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    const auto ql = st.q_layout(c.s, n), kl = st.kv_layout(c.s, n);
    c.in.q = ql.shard(at::randn({2, sq, 4, 8}, gen, at::kFloat), 1, r);
    c.in.k = kl.shard(at::randn({2, skv, 2, 8}, gen, at::kFloat), 1, r);
    c.in.v = kl.shard(at::randn({2, skv, 2, 8}, gen, at::kFloat), 1, r);
    c.dout = ql.shard(at::randn({2, sq, 4, 8}, gen, at::kFloat), 1, r);
    c.in.mask.q_media = (at::div(at::arange(sq, at::kLong) * 3, sq, "floor") - 1)
                            .to(at::kInt).view({1, -1}).repeat({2, 1});
    c.in.mask.kv_media =
        at::div(at::arange(skv, at::kLong) * 2, skv, "floor").to(at::kInt).view({1, -1}).repeat({2, 1});
    return c;
  };
  int bad = 0;
  std::vector<attention::StrategyChoice> choices;
  for (auto k : attention::all_strategies()) choices.emplace_back(k);
  choices.push_back(attention::strategy_choice_from_name("lv_xattn+ring"));
  choices.push_back(attention::strategy_choice_from_name("ring+lv_xattn"));
  for (const auto& choice : choices) {
    auto fwd = attention::make_strategy(choice.forward), bwd = attention::make_strategy(choice.backward);
    if (choice.forward == attention::StrategyKind::kUlysses && 2 % n != 0) continue;  // Hkv = 2
    std::vector<Call> calls = {make_call(*fwd, 12, 20, MaskKind::kMedia, 1),
                               make_call(*fwd, 9, 9, MaskKind::kCausal, 2),
                               make_call(*fwd, 5, 17, MaskKind::kNone, 3)};
    if (choice.forward == attention::StrategyKind::kDistFlash)  // causal self-attention only
      calls = {make_call(*fwd, 12, 12, MaskKind::kCausal, 1), make_call(*fwd, 9, 9, MaskKind::kCausal, 2),
               make_call(*fwd, 5, 5, MaskKind::kCausal, 3)};
    // Alone: forward then backward, call by call.
    std::vector<attention::LocalGrads> alone;
    std::vector<at::Tensor> alone_o;
    for (auto& c : calls) {
      attention::SavedState st;
      alone_o.push_back(fwd->forward(*pg, c.s, c.in, &st).o);
      alone.push_back(bwd->backward(*pg, c.s, c.in.mask, st, c.dout));
    }
    // Interleaved on the same objects: all forwards, then backwards in reverse order.
    std::vector<attention::SavedState> saved(calls.size());
    std::vector<at::Tensor> outs;
    for (size_t i = 0; i < calls.size(); ++i)
      outs.push_back(fwd->forward(*pg, calls[i].s, calls[i].in, &saved[i]).o);
    for (size_t i = calls.size(); i-- > 0;) {
      attention::LocalGrads g = bwd->backward(*pg, calls[i].s, calls[i].in.mask, saved[i], calls[i].dout);
      if (!outs[i].equal(alone_o[i]) || !g.dq.equal(alone[i].dq) || !g.dk.equal(alone[i].dk) ||
          !g.dv.equal(alone[i].dv)) {
        std::cerr << "rank " << r << " " << choice.name() << ": call " << i
                  << " interleaved differs from the call alone\n";
        ++bad;
      }
    }
  }
  return bad;
}

TEST(Strategies, InterleavedCallsEqualSeparateCalls) {
  for (int world : {1, 2, 3})
    lvx::testing::expect_all_ok(lvx::testing::run_ranks(world, "interleaved", 120));
}

TEST(Strategies, PairsOnlyWhenTheBackwardCanUseTheForwardsState) {
  EXPECT_TRUE(attention::can_pair(attention::StrategyKind::kLvXAttn, attention::StrategyKind::kRing));
  EXPECT_TRUE(attention::can_pair(attention::StrategyKind::kRing, attention::StrategyKind::kLvXAttn));
  EXPECT_FALSE(attention::can_pair(attention::StrategyKind::kLvXAttn, attention::StrategyKind::kStriped));
  EXPECT_FALSE(attention::can_pair(attention::StrategyKind::kUlysses, attention::StrategyKind::kRing));
  EXPECT_FALSE(attention::can_pair(attention::StrategyKind::kAllGather, attention::StrategyKind::kRing));
  EXPECT_EQ(attention::strategy_choice_from_name("lv_xattn+ring").name(), "lv_xattn+ring");
  EXPECT_EQ(attention::strategy_choice_from_name("ring").name(), "ring");
  try {
    attention::strategy_choice_from_name("ring+ulysses");
    FAIL();
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot start from what the forward of ring saves"),
              std::string::npos)
        << e.what();
  }
}
