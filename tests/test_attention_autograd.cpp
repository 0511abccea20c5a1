// dist_attention (src/attention/dist_attention.h) as an autograd function: every strategy's leaf
// gradients inside a graph against an fp64 dense attention differentiated by autograd, and the
// double ring that the launcher's nodes (LOCAL_WORLD_SIZE) select, its inter-node bytes included.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <memory>
#include <string>

#include "src/attention/dist_attention.h"
#include "src/attention/strategy.h"
#include "tests/attention_test_util.h"
#include "tests/multirank.h"

using namespace lvx;
using namespace lvx::attention::testing;
using attention::AttentionSpec;
using kernels::MaskKind;

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
      auto S =
          at::matmul(qr.permute({0, 2, 1, 3}), kr.repeat_interleave(g, 2).permute({0, 2, 3, 1})) /
          std::sqrt(double(s.head_dim));
      S = S.masked_fill(vis.unsqueeze(1).logical_not(), -INFINITY);
      auto lse = at::logsumexp(S, -1);  // [B, H, Sq]
      auto P = at::softmax(S, -1);
      auto O =
          at::matmul(P, vr.repeat_interleave(g, 2).permute({0, 2, 1, 3})).permute({0, 2, 1, 3});
      ((O * dout).sum() + (lse * dl).sum()).backward();
    }
    const auto ql = strategy->q_layout(s, n), kl = strategy->kv_layout(s, n);
    auto q_leaf = ql.shard(q, 1, r).requires_grad_();
    auto k_leaf = kl.shard(k, 1, r).requires_grad_();
    auto v_leaf = kl.shard(v, 1, r).requires_grad_();
    auto res =
        attention::dist_attention(q_leaf * 2, k_leaf, v_leaf, pg, kind, s, {{}, {}, kv_valid});
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
  auto q = at::randn({1, 16, 2, 8}, gen, at::kDouble),
       k = at::randn({1, 16, 2, 8}, gen, at::kDouble);
  auto v = at::randn({1, 16, 2, 8}, gen, at::kDouble),
       dout = at::randn({1, 16, 2, 8}, gen, at::kDouble);
  const auto ring = attention::make_strategy(attention::StrategyKind::kRing);
  const auto l = ring->q_layout(s, n);
  auto q_leaf = l.shard(q, 1, r).requires_grad_(), k_leaf = l.shard(k, 1, r).requires_grad_();
  auto v_leaf = l.shard(v, 1, r).requires_grad_();
  pg->counters().reset();
  auto res =
      attention::dist_attention(q_leaf, k_leaf, v_leaf, pg, attention::StrategyKind::kRing, s);
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
  const double e =
      std::max({max_err(res.o, l.shard(ref.o, 1, r)), max_err(q_leaf.grad(), l.shard(ref.dq, 1, r)),
                max_err(k_leaf.grad(), l.shard(ref.dk, 1, r)),
                max_err(v_leaf.grad(), l.shard(ref.dv, 1, r))});
  if (!(e < 1e-10)) {
    std::cerr << "rank " << r << ": double ring error " << e << "\n";
    ++bad;
  }
  return bad;
}

TEST(Strategies, DoubleRingFollowsTheLaunchersNodes) {
  lvx::testing::expect_all_ok(
      lvx::testing::run_ranks(4, "double_ring_from_launcher", 120, {{"LOCAL_WORLD_SIZE", "2"}}));
}

TEST(Autograd, EveryStrategyIsDifferentiableInAGraph) {
  for (int world : {1, 2, 3})
    lvx::testing::expect_all_ok(lvx::testing::run_ranks(world, "autograd", 120));
}
