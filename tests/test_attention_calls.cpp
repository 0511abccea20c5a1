// Several calls on one strategy object, as a model's layers make them: interleaved forwards and
// backwards equal each call alone (also for a forward of one strategy and a backward of another),
// and which forward/backward pairs may share the forward's saved state (can_pair).
#include <gtest/gtest.h>

#include <iostream>
#include <string>
#include <vector>

#include "src/attention/strategy.h"
#include "src/common/error.h"
#include "tests/multirank.h"

using namespace lvx;
using attention::AttentionSpec;
using attention::LocalInputs;
using kernels::MaskKind;
using kernels::MediaRule;

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
                            .to(at::kInt)
                            .view({1, -1})
                            .repeat({2, 1});
    c.in.mask.kv_media = at::div(at::arange(skv, at::kLong) * 2, skv, "floor")
                             .to(at::kInt)
                             .view({1, -1})
                             .repeat({2, 1});
    return c;
  };
  int bad = 0;
  std::vector<attention::StrategyChoice> choices;
  for (auto k : attention::all_strategies()) choices.emplace_back(k);
  choices.push_back(attention::strategy_choice_from_name("lv_xattn+ring"));
  choices.push_back(attention::strategy_choice_from_name("ring+lv_xattn"));
  for (const auto& choice : choices) {
    auto fwd = attention::make_strategy(choice.forward),
         bwd = attention::make_strategy(choice.backward);
    if (choice.forward == attention::StrategyKind::kUlysses && 2 % n != 0) continue;  // Hkv = 2
    std::vector<Call> calls = {make_call(*fwd, 12, 20, MaskKind::kMedia, 1),
                               make_call(*fwd, 9, 9, MaskKind::kCausal, 2),
                               make_call(*fwd, 5, 17, MaskKind::kNone, 3)};
    if (choice.forward == attention::StrategyKind::kDistFlash)  // causal self-attention only
      calls = {make_call(*fwd, 12, 12, MaskKind::kCausal, 1),
               make_call(*fwd, 9, 9, MaskKind::kCausal, 2),
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
      attention::LocalGrads g =
          bwd->backward(*pg, calls[i].s, calls[i].in.mask, saved[i], calls[i].dout);
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
  EXPECT_TRUE(
      attention::can_pair(attention::StrategyKind::kLvXAttn, attention::StrategyKind::kRing));
  EXPECT_TRUE(
      attention::can_pair(attention::StrategyKind::kRing, attention::StrategyKind::kLvXAttn));
  EXPECT_FALSE(
      attention::can_pair(attention::StrategyKind::kLvXAttn, attention::StrategyKind::kStriped));
  EXPECT_FALSE(
      attention::can_pair(attention::StrategyKind::kUlysses, attention::StrategyKind::kRing));
  EXPECT_FALSE(
      attention::can_pair(attention::StrategyKind::kAllGather, attention::StrategyKind::kRing));
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
