// distflash: DistFlashAttn's load-balanced causal schedule (Li et al., "DistFlashAttn: Distributed
// Memory-efficient Attention for Long-context LLMs Training", §3.1, Alg. 2; backward as in its
// code, §3.5 of our notes). Contiguous shards, causal self-attention (Sq = Skv): the query shard
// of rank p needs the key shards 0..p, so under a plain ring rank 0 idles n − 1 of n rounds.
//
// Rounds (0-indexed ranks, n ranks, T = ⌊n/2⌋):
//   round 0      every rank attends its own diagonal block (q_p, kv_p), causal inside.
//   round t ≥ 1  owner  p ≥ t: attends q_p to kv_{p−t} (fetched from rank p − t);
//                helper h < t (already done): attends q_o of the late rank o = h − t + n to its
//                own kv_h, from fresh statistics, and returns (O, lse) in fp32 to o, which merges
//                them (LSE merge, §0 of the notes).
// Owners cover the pairs at distance 1..T, helpers those at distance n − t for the helper rounds
// H = {t ≤ T : 2t ≠ n}. For even n the guard 2t ≠ n is the paper's "t ≠ ⌊P/2⌋" (distance n/2 is
// an owner pair); for odd n there is no guard: the paper's printed guard would drop the pairs at
// distance ⌈n/2⌉ (rank 4 of 5 would never see kv_1), which is the trap its notes record.
// Idle rank-rounds: n even, ranks < T in round T; n odd, none — versus n(n−1)/2 of n² for the
// plain contiguous ring.
//
// Overlap: the messages of round t + 1 (K/V to the owner, Q to the helper) are posted before
// round t computes; helper results travel during the next round and are merged at the end, in a
// fixed order (bitwise deterministic).
//
// Backward: the same rounds. An owner's round gives dq locally and (dk, dv) of kv_{p−t} in fp32,
// sent back to p − t; a helper receives the late rank's (q, dO, lse, delta), keeps dk, dv and
// returns dq in fp32. Per-rank bytes are in strategy.h; schedule() lists each message.
#include <limits>
#include <utility>
#include <vector>

#include "src/attention/strategy.h"
#include "src/common/error.h"

namespace lvx::attention {
namespace {

using dist::P2POp;

// The owner rank h helps in round t, or −1.
int helped_owner(int n, int t, int h) { return (2 * t != n && h < t) ? h - t + n : -1; }
// The helper of owner o in round t, or −1.
int helper_of(int n, int t, int o) { return (2 * t != n && o >= n - t) ? o + t - n : -1; }

at::Tensor empty_like_len(const at::Tensor& like, int64_t dim, int64_t len, at::ScalarType dtype) {
  auto shape = like.sizes().vec();
  shape[dim] = len;
  return at::empty(shape, like.options().dtype(dtype));
}

// The K/V messages of round t: this rank's K/V to rank r + t, and (an owner, r ≥ t) the K/V of
// rank r − t into new *k_in, *v_in.
void add_kv_ops(int n, int r, int t, const Layout& l, const at::Tensor& k, const at::Tensor& v,
                std::vector<P2POp>* ops, at::Tensor* k_in, at::Tensor* v_in) {
  if (r + t < n) {
    ops->push_back(P2POp::send(k, r + t));
    ops->push_back(P2POp::send(v, r + t));
  }
  if (r >= t) {
    *k_in = empty_like_len(k, 1, l.local_size(r - t), k.scalar_type());
    *v_in = empty_like_len(v, 1, l.local_size(r - t), v.scalar_type());
    ops->push_back(P2POp::recv(*k_in, r - t));
    ops->push_back(P2POp::recv(*v_in, r - t));
  }
}

// One rank's view of the forward: the ranks, the shards' layout, the accumulation dtype and the
// inputs made contiguous.
struct ForwardContext {
  dist::ProcessGroup& pg;
  const AttentionSpec& s;
  const MaskInputs& mask;
  int n, r;
  Layout l;
  at::ScalarType acc;
  at::Tensor q, k, v;
};

// This rank's running (O, lse) in fp32, and the helpers' (O, lse) for its queries, merged at the
// end in round order, once every result request (sent or received) is done.
struct ForwardSums {
  at::Tensor o, lse;
  std::vector<std::pair<at::Tensor, at::Tensor>> returned;
  std::vector<dist::Work> results;
};

// Attention of queries `q` (owner qo) to keys (owner ko): a fresh (O, lse) in fp32; O = 0 and
// lse = −inf when either side is empty.
kernels::AttentionOutput attend_block(const ForwardContext& x, const at::Tensor& q, int qo,
                                      const at::Tensor& k, const at::Tensor& v, int ko) {
  const double inf = std::numeric_limits<double>::infinity();
  kernels::AttentionOutput part;
  if (q.size(1) > 0 && k.size(1) > 0) {
    part = kernels::attention_forward(
        q, k, v, block_params(x.s, x.mask, x.l.positions(qo), x.l.positions(ko)));
    part.o = part.o.to(x.acc).contiguous();
    part.lse = part.lse.contiguous();
  } else {
    part.o = at::zeros(q.sizes(), q.options().dtype(x.acc));
    part.lse = at::full({x.s.batch, x.s.hq, q.size(1)}, -inf, q.options().dtype(x.acc));
  }
  return part;
}

// What a forward round receives ahead: kv_{r−t} (owner) or the helped rank's Q (helper).
struct ForwardAhead {
  at::Tensor k, v, q;
  dist::Work work;
};

// Posts the messages of forward round t: this rank's K/V to r + t and Q to its helper; receives
// kv_{r−t} (owner) or the helped rank's Q (helper).
ForwardAhead post_forward_round(const ForwardContext& x, int t) {
  ForwardAhead a;
  std::vector<P2POp> ops;
  add_kv_ops(x.n, x.r, t, x.l, x.k, x.v, &ops, &a.k, &a.v);
  if (const int h = helper_of(x.n, t, x.r); h >= 0) ops.push_back(P2POp::send(x.q, h));
  if (const int ow = helped_owner(x.n, t, x.r); ow >= 0) {
    a.q = empty_like_len(x.q, 1, x.l.local_size(ow), x.q.scalar_type());
    ops.push_back(P2POp::recv(a.q, ow));
  }
  if (!ops.empty()) a.work = x.pg.batch_isend_irecv(std::move(ops), "distflash forward K/V/Q");
  return a;
}

// Round 0: the diagonal block (q_r against kv_r), merged into this rank's (O, lse).
void merge_diagonal_block(const ForwardContext& x, ForwardSums* sums) {
  auto part = attend_block(x, x.q, x.r, x.k, x.v, x.r);
  kernels::merge_attention_states(sums->o, sums->lse, part.o, part.lse);
}

// Round t ≥ 1 with its messages in (cur): the owner's block merged here, or the helper's (O, lse)
// sent back to the late rank, and the receive of this rank's helped result, posted together.
void forward_round(const ForwardContext& x, int t, const ForwardAhead& cur, ForwardSums* sums) {
  std::vector<P2POp> ops;
  if (x.r >= t) {  // owner: my queries against kv_{r−t}
    auto part = attend_block(x, x.q, x.r, cur.k, cur.v, x.r - t);
    kernels::merge_attention_states(sums->o, sums->lse, part.o, part.lse);
  } else if (const int ow = helped_owner(x.n, t, x.r); ow >= 0) {  // helper for rank ow
    auto part = attend_block(x, cur.q, ow, x.k, x.v, x.r);
    ops.push_back(P2POp::send(part.o, ow));
    ops.push_back(P2POp::send(part.lse, ow));
  }
  if (const int h = helper_of(x.n, t, x.r); h >= 0) {
    sums->returned.emplace_back(at::empty(sums->o.sizes(), sums->o.options()),
                                at::empty(sums->lse.sizes(), sums->lse.options()));
    ops.push_back(P2POp::recv(sums->returned.back().first, h));
    ops.push_back(P2POp::recv(sums->returned.back().second, h));
  }
  if (!ops.empty())
    sums->results.push_back(x.pg.batch_isend_irecv(std::move(ops), "distflash forward O/lse"));
}

// Waits for every result request, merges the helpers' (O, lse) in round order, and casts O to
// the inputs' dtype.
LocalOutput finish_forward(const ForwardContext& x, ForwardSums* sums) {
  for (auto& w : sums->results) w.wait();
  for (auto& [ro, rl] : sums->returned) kernels::merge_attention_states(sums->o, sums->lse, ro, rl);
  return LocalOutput{sums->o.to(x.q.scalar_type()), sums->lse};
}

// One rank's view of the backward: the ranks, the shards' layout, the saved inputs (made
// contiguous), dO in the inputs' dtype and the softmax statistics (lse, delta).
struct BackwardContext {
  dist::ProcessGroup& pg;
  const AttentionSpec& s;
  const MaskInputs& mask;
  int n, r;
  Layout l;
  at::Tensor q, k, v, lse;
  at::ScalarType dt, acc;
  at::Tensor delta, dO;
};

// Reads the saved inputs, made contiguous, and derives delta and dO.
BackwardContext backward_context(dist::ProcessGroup& pg, const AttentionSpec& s,
                                 const MaskInputs& mask, int n, int r, const Layout& l,
                                 const SavedState& saved, const at::Tensor& dout,
                                 const at::Tensor& dlse) {
  const at::Tensor q = saved.tensors.at(0).contiguous(), k = saved.tensors.at(1).contiguous(),
                   v = saved.tensors.at(2).contiguous();
  const at::Tensor &o = saved.tensors.at(3), lse = saved.tensors.at(4).contiguous();
  const auto dt = q.scalar_type();
  const auto acc = kernels::accumulation_dtype(dt);
  const at::Tensor delta = backward_delta(dout, o, dlse).contiguous();
  const at::Tensor dO = dout.to(dt).contiguous();
  return {pg, s, mask, n, r, l, q, k, v, lse, dt, acc, delta, dO};
}

// This rank's gradients in fp32, and the partial gradients of its shards computed elsewhere (dk
// and dv from the owner r + t, dq from the helper), added at the end in round order, once every
// result request is done.
struct BackwardSums {
  at::Tensor dq, dk, dv;
  std::vector<std::pair<at::Tensor, at::Tensor>> returned_kv;
  std::vector<at::Tensor> returned_q;
  std::vector<dist::Work> results;
};

// The three gradients of one block, in fp32.
struct BlockGrads {
  at::Tensor dq, dk, dv;
};

// The fp32 gradients of one block: queries qq (owner qo, with their dO, lse and delta) against
// keys kk, vv (owner ko); zeros when either side is empty.
BlockGrads block_grads(const BackwardContext& x, const at::Tensor& qq, const at::Tensor& d_o,
                       const at::Tensor& l_, const at::Tensor& de, int qo, const at::Tensor& kk,
                       const at::Tensor& vv, int ko) {
  if (qq.size(1) == 0 || kk.size(1) == 0)
    return BlockGrads{at::zeros(qq.sizes(), qq.options().dtype(x.acc)),
                      at::zeros(kk.sizes(), kk.options().dtype(x.acc)),
                      at::zeros(vv.sizes(), vv.options().dtype(x.acc))};
  auto g = kernels::attention_backward(
      qq, kk, vv, d_o, l_, de, block_params(x.s, x.mask, x.l.positions(qo), x.l.positions(ko)));
  return BlockGrads{g.dq.to(x.acc).contiguous(), g.dk.to(x.acc).contiguous(),
                    g.dv.to(x.acc).contiguous()};
}

// What a backward round receives ahead: kv_{r−t} (owner) or the helped rank's Q side.
struct BackwardAhead {
  at::Tensor k, v, q, dO, lse, delta;
  dist::Work work;
};

// Posts the messages of backward round t: this rank's K/V to r + t and its (q, dO, lse, delta)
// to its helper; receives kv_{r−t} (owner) or the helped rank's (q, dO, lse, delta) (helper).
BackwardAhead post_backward_round(const BackwardContext& x, int t) {
  BackwardAhead a;
  std::vector<P2POp> ops;
  add_kv_ops(x.n, x.r, t, x.l, x.k, x.v, &ops, &a.k, &a.v);
  if (const int h = helper_of(x.n, t, x.r); h >= 0)
    for (const at::Tensor* m : {&x.q, &x.dO, &x.lse, &x.delta}) ops.push_back(P2POp::send(*m, h));
  if (const int ow = helped_owner(x.n, t, x.r); ow >= 0) {
    const int64_t len = x.l.local_size(ow);
    a.q = empty_like_len(x.q, 1, len, x.dt);
    a.dO = empty_like_len(x.dO, 1, len, x.dt);
    a.lse = empty_like_len(x.lse, 2, len, x.lse.scalar_type());
    a.delta = empty_like_len(x.delta, 2, len, x.delta.scalar_type());
    for (const at::Tensor* m : {&a.q, &a.dO, &a.lse, &a.delta}) ops.push_back(P2POp::recv(*m, ow));
  }
  if (!ops.empty())
    a.work = x.pg.batch_isend_irecv(std::move(ops), "distflash backward K/V/Q/dO/lse/delta");
  return a;
}

// Round 0: the diagonal block (q_r against kv_r); all three gradients stay.
void add_diagonal_grads(const BackwardContext& x, BackwardSums* sums) {
  BlockGrads g = block_grads(x, x.q, x.dO, x.lse, x.delta, x.r, x.k, x.v, x.r);
  sums->dq.add_(g.dq);
  sums->dk.add_(g.dk);
  sums->dv.add_(g.dv);
}

// Round t ≥ 1 with its messages in (cur): the owner's or the helper's block, then the partial
// gradients sent back and the receives of those coming back to this rank, posted together.
void backward_round(const BackwardContext& x, int t, const BackwardAhead& cur, BackwardSums* sums) {
  std::vector<P2POp> ops;
  if (x.r >= t) {  // owner: dq stays, dk/dv go back to r − t
    BlockGrads g = block_grads(x, x.q, x.dO, x.lse, x.delta, x.r, cur.k, cur.v, x.r - t);
    sums->dq.add_(g.dq);
    ops.push_back(P2POp::send(g.dk, x.r - t));
    ops.push_back(P2POp::send(g.dv, x.r - t));
  } else if (const int ow = helped_owner(x.n, t, x.r); ow >= 0) {  // helper: dk/dv stay
    BlockGrads g = block_grads(x, cur.q, cur.dO, cur.lse, cur.delta, ow, x.k, x.v, x.r);
    sums->dk.add_(g.dk);
    sums->dv.add_(g.dv);
    ops.push_back(P2POp::send(g.dq, ow));
  }
  if (x.r + t < x.n) {
    sums->returned_kv.emplace_back(at::empty(sums->dk.sizes(), sums->dk.options()),
                                   at::empty(sums->dv.sizes(), sums->dv.options()));
    ops.push_back(P2POp::recv(sums->returned_kv.back().first, x.r + t));
    ops.push_back(P2POp::recv(sums->returned_kv.back().second, x.r + t));
  }
  if (const int h = helper_of(x.n, t, x.r); h >= 0) {
    sums->returned_q.push_back(at::empty(sums->dq.sizes(), sums->dq.options()));
    ops.push_back(P2POp::recv(sums->returned_q.back(), h));
  }
  if (!ops.empty())
    sums->results.push_back(x.pg.batch_isend_irecv(std::move(ops), "distflash backward dQ/dK/dV"));
}

// Waits for every result request, adds the returned partial gradients in round order, and
// casts the gradients to the inputs' dtype.
LocalGrads finish_backward(const BackwardContext& x, BackwardSums* sums) {
  for (auto& w : sums->results) w.wait();
  for (auto& [rk, rv] : sums->returned_kv) {
    sums->dk.add_(rk);
    sums->dv.add_(rv);
  }
  for (auto& rq : sums->returned_q) sums->dq.add_(rq);
  return {sums->dq.to(x.dt), sums->dk.to(x.dt), sums->dv.to(x.dt)};
}

class DistFlashStrategy : public Strategy {
 public:
  StrategyKind kind() const override { return StrategyKind::kDistFlash; }
  Layout q_layout(const AttentionSpec& s, int world) const override {
    return Layout{LayoutKind::kContiguous, s.sq, world};
  }
  Layout kv_layout(const AttentionSpec& s, int world) const override {
    return Layout{LayoutKind::kContiguous, s.skv, world};
  }

  void check_supported(const AttentionSpec& s, int world) const override {
    LVX_CHECK(s.mask == kernels::MaskKind::kCausal && s.sq == s.skv,
              "strategy distflash balances causal self-attention (mask causal, Sq = Skv); this "
              "call has mask ",
              s.mask == kernels::MaskKind::kNone     ? "none"
              : s.mask == kernels::MaskKind::kCausal ? "causal"
                                                     : "media",
              ", Sq=", s.sq, ", Skv=", s.skv, " (use ring, striped or lv_xattn)");
  }

  LocalOutput forward(dist::ProcessGroup& pg, const AttentionSpec& s, const LocalInputs& in,
                      SavedState* saved) const override {
    check_supported(s, pg.world_size());
    const int n = pg.world_size(), r = pg.rank();
    const Layout l = q_layout(s, n);
    const auto acc = kernels::accumulation_dtype(in.q.scalar_type());
    const double inf = std::numeric_limits<double>::infinity();
    ForwardSums sums;
    sums.o = at::zeros(in.q.sizes(), in.q.options().dtype(acc));
    sums.lse = at::full({s.batch, s.hq, in.q.size(1)}, -inf, in.q.options().dtype(acc));
    const ForwardContext x{
        pg, s, in.mask, n, r, l, acc, in.q.contiguous(), in.k.contiguous(), in.v.contiguous()};
    const int T = n / 2;
    ForwardAhead next = T >= 1 ? post_forward_round(x, 1) : ForwardAhead{};
    merge_diagonal_block(x, &sums);
    for (int t = 1; t <= T; ++t) {
      if (next.work.valid()) next.work.wait();
      ForwardAhead cur = std::move(next);
      if (t < T) next = post_forward_round(x, t + 1);
      forward_round(x, t, cur, &sums);
    }
    LocalOutput out = finish_forward(x, &sums);
    if (saved) saved->tensors = {in.q, in.k, in.v, out.o, out.lse};
    return out;
  }

  LocalGrads backward(dist::ProcessGroup& pg, const AttentionSpec& s, const MaskInputs& mask,
                      const SavedState& saved, const at::Tensor& dout,
                      const at::Tensor& dlse) const override {
    check_supported(s, pg.world_size());
    const int n = pg.world_size(), r = pg.rank();
    const Layout l = q_layout(s, n);
    const BackwardContext x = backward_context(pg, s, mask, n, r, l, saved, dout, dlse);
    BackwardSums sums;
    sums.dq = at::zeros(x.q.sizes(), x.q.options().dtype(x.acc));
    sums.dk = at::zeros(x.k.sizes(), x.k.options().dtype(x.acc));
    sums.dv = at::zeros(x.v.sizes(), x.v.options().dtype(x.acc));
    const int T = n / 2;
    BackwardAhead next = T >= 1 ? post_backward_round(x, 1) : BackwardAhead{};
    add_diagonal_grads(x, &sums);
    for (int t = 1; t <= T; ++t) {
      if (next.work.valid()) next.work.wait();
      BackwardAhead cur = std::move(next);
      if (t < T) next = post_backward_round(x, t + 1);
      backward_round(x, t, cur, &sums);
    }
    return finish_backward(x, &sums);
  }

  PassSchedule schedule(const AttentionSpec& s, int n, int r, at::ScalarType dtype,
                        bool backward) const override {
    const Layout l = q_layout(s, n);
    const int64_t e = element_bytes(dtype);
    const int64_t a = element_bytes(kernels::accumulation_dtype(dtype));
    const int64_t q_tok = s.batch * s.hq * s.head_dim, kv_tok = 2 * s.batch * s.hkv * s.head_dim;
    const int64_t stat_tok = s.batch * s.hq;
    // Per token: what goes ahead to an owner (K/V) and to a helper (Q side), and what comes back.
    const int64_t kv_ahead = kv_tok * e;
    const int64_t q_ahead = backward ? 2 * q_tok * e + 2 * stat_tok * a : q_tok * e;
    const int64_t kv_back = backward ? kv_tok * a : 0;                     // dK/dV to the key owner
    const int64_t q_back = backward ? q_tok * a : (q_tok + stat_tok) * a;  // dQ, or O/lse
    const int T = n / 2;
    PassSchedule p;
    p.rounds.push_back(Block{r, r});
    auto add = [&](const char* what, int round, int peer, int64_t sent, int64_t received) {
      if (sent > 0 || received > 0)
        p.messages.push_back({what, Message::kRingHop, round, sent, received, peer, 1});
    };
    for (int t = 1; t <= T; ++t) {
      const int ow = helped_owner(n, t, r), h = helper_of(n, t, r);
      p.rounds.push_back(r >= t ? Block{r, r - t} : ow >= 0 ? Block{ow, r} : Block::none());
      // Ahead of round t, during round t − 1.
      if (r + t < n) add("K/V", t - 1, r + t, l.local_size(r) * kv_ahead, 0);
      if (r >= t) add("K/V", t - 1, r - t, 0, l.local_size(r - t) * kv_ahead);
      if (h >= 0) add(backward ? "Q/dO/lse/delta" : "Q", t - 1, h, l.local_size(r) * q_ahead, 0);
      if (ow >= 0) add(backward ? "Q/dO/lse/delta" : "Q", t - 1, ow, 0, l.local_size(ow) * q_ahead);
      // Results of round t, during round t + 1 (t = T: after the last round).
      if (r >= t) add("dK/dV", t + 1, r - t, l.local_size(r - t) * kv_back, 0);
      if (r + t < n) add("dK/dV", t + 1, r + t, 0, l.local_size(r) * kv_back);
      if (ow >= 0) add(backward ? "dQ" : "O/lse", t + 1, ow, l.local_size(ow) * q_back, 0);
      if (h >= 0) add(backward ? "dQ" : "O/lse", t + 1, h, 0, l.local_size(r) * q_back);
    }
    return p;
  }
};

}  // namespace

std::unique_ptr<Strategy> make_distflash() { return std::make_unique<DistFlashStrategy>(); }

}  // namespace lvx::attention
