// lv_xattn: K/V stationary, the small query side rotates (LV-XAttn, Chang & Venkataraman,
// ICML'25, §3.1, Fig. 3, eq. (1)). Round t on rank r works on the query block of rank r − t:
//   1. post the next query block's transfer (Q_{r−t−1} from prev) — overlapped with step 2;
//   2. attend Q_{r−t} to the local K_r/V_r, giving a partial (O, lse) in fp32;
//   3. merge it into the block's running (O, lse), which arrived from prev during step 2, and
//      send the sum on to next — also overlapped with the next round's compute.
// After n rounds each block's (O, lse) has visited every rank and its last hop brings it home.
// Backward (BurstAttention Alg. 2; NOTES.md §2.3): the bundle (Q, dO, lse, delta) rotates the same
// way with the fp32 dQ accumulator following it; dK and dV never leave the rank.
#include "src/attention/strategy.h"
#include "src/common/error.h"

namespace lvx::attention {
namespace {

using dist::P2POp;

class LvXAttnStrategy : public Strategy {
 public:
  StrategyKind kind() const override { return StrategyKind::kLvXAttn; }

  LocalOutput forward(dist::ProcessGroup& pg, const AttentionSpec& s,
                      const LocalInputs& in) override {
    const int n = pg.world_size(), r = pg.rank();
    const Layout ql = q_layout(s, n), kl = kv_layout(s, n);
    const at::Tensor k_pos = kl.positions(r);
    const auto acc = kernels::accumulation_dtype(in.q.scalar_type());
    at::Tensor q = in.q;
    int owner = r;
    dist::Work acc_exchange;
    at::Tensor o_in, lse_in;
    for (int step = 0; step < n; ++step) {
      const int next_owner = (owner - 1 + n) % n;
      dist::Work prefetch;
      at::Tensor q_next;
      if (step + 1 < n) {
        q_next = at::empty({s.batch, ql.local_size(next_owner), s.hq, s.head_dim}, q.options());
        prefetch = pg.batch_isend_irecv({P2POp::send(q, pg.next()), P2POp::recv(q_next, pg.prev())},
                                        "lv_xattn forward Q");
      }
      const int64_t sq = q.size(1);
      kernels::AttentionOutput part;
      if (sq > 0 && in.k.size(1) > 0) {
        part = kernels::attention_forward(q, in.k, in.v,
                                          block_params(s, in, ql.positions(owner), k_pos));
      } else {
        part.o = at::zeros(q.sizes(), q.options().dtype(acc));
        part.lse = at::full({s.batch, s.hq, sq}, -std::numeric_limits<double>::infinity(),
                            q.options().dtype(acc));
      }
      if (step > 0) {
        acc_exchange.wait();
        kernels::merge_attention_states(part.o, part.lse, o_in, lse_in);
      }
      if (n == 1) return {part.o, part.lse};
      const int incoming = step + 1 < n ? next_owner : r;
      o_in = at::empty({s.batch, ql.local_size(incoming), s.hq, s.head_dim},
                       q.options().dtype(acc));
      lse_in = at::empty({s.batch, s.hq, ql.local_size(incoming)}, q.options().dtype(acc));
      acc_exchange = pg.batch_isend_irecv(
          {P2POp::send(part.o, pg.next()), P2POp::send(part.lse, pg.next()),
           P2POp::recv(o_in, pg.prev()), P2POp::recv(lse_in, pg.prev())},
          "lv_xattn forward O/lse");
      if (step + 1 < n) {
        prefetch.wait();
        q = q_next;
        owner = next_owner;
      }
    }
    acc_exchange.wait();
    return {o_in, lse_in};
  }

  LocalGrads backward(dist::ProcessGroup& pg, const AttentionSpec& s, const LocalInputs& in,
                      const at::Tensor& o, const at::Tensor& lse,
                      const at::Tensor& dout) override {
    const int n = pg.world_size(), r = pg.rank();
    const Layout ql = q_layout(s, n), kl = kv_layout(s, n);
    const at::Tensor k_pos = kl.positions(r);
    const auto acc = kernels::accumulation_dtype(in.q.scalar_type());
    at::Tensor q = in.q, dO = dout.to(in.q.scalar_type()).contiguous(), l = lse.contiguous();
    at::Tensor delta = kernels::attention_delta(dout, o);  // at home, from the final O
    at::Tensor dk = at::zeros(in.k.sizes(), in.k.options().dtype(acc));
    at::Tensor dv = at::zeros(in.v.sizes(), in.v.options().dtype(acc));
    int owner = r;
    dist::Work acc_exchange;
    at::Tensor dq_in;
    for (int step = 0; step < n; ++step) {
      const int next_owner = (owner - 1 + n) % n;
      dist::Work prefetch;
      at::Tensor q_next, do_next, lse_next, delta_next;
      if (step + 1 < n) {
        const int64_t m = ql.local_size(next_owner);
        q_next = at::empty({s.batch, m, s.hq, s.head_dim}, q.options());
        do_next = at::empty({s.batch, m, s.hq, s.head_dim}, dO.options());
        lse_next = at::empty({s.batch, s.hq, m}, l.options());
        delta_next = at::empty({s.batch, s.hq, m}, delta.options());
        prefetch = pg.batch_isend_irecv(
            {P2POp::send(q, pg.next()), P2POp::send(dO, pg.next()), P2POp::send(l, pg.next()),
             P2POp::send(delta, pg.next()), P2POp::recv(q_next, pg.prev()),
             P2POp::recv(do_next, pg.prev()), P2POp::recv(lse_next, pg.prev()),
             P2POp::recv(delta_next, pg.prev())},
            "lv_xattn backward Q/dO/lse/delta");
      }
      at::Tensor dq_part;  // this rank's contribution to the held query block's dQ
      if (q.size(1) > 0 && in.k.size(1) > 0) {
        auto g = kernels::attention_backward(q, in.k, in.v, dO, l, delta,
                                             block_params(s, in, ql.positions(owner), k_pos));
        dq_part = g.dq;
        dk.add_(g.dk);
        dv.add_(g.dv);
      } else {
        dq_part = at::zeros(q.sizes(), q.options().dtype(acc));
      }
      if (step > 0) {
        acc_exchange.wait();
        dq_part.add_(dq_in);
      }
      if (n == 1) return {dq_part, dk, dv};
      const int incoming = step + 1 < n ? next_owner : r;
      dq_in = at::empty({s.batch, ql.local_size(incoming), s.hq, s.head_dim},
                        q.options().dtype(acc));
      acc_exchange = pg.batch_isend_irecv(
          {P2POp::send(dq_part, pg.next()), P2POp::recv(dq_in, pg.prev())}, "lv_xattn backward dQ");
      if (step + 1 < n) {
        prefetch.wait();
        q = q_next;
        dO = do_next;
        l = lse_next;
        delta = delta_next;
        owner = next_owner;
      }
    }
    acc_exchange.wait();
    return {dq_in, dk, dv};
  }

  Volume analytic_bytes(const AttentionSpec& s, int n, int r, at::ScalarType dtype,
                        bool backward) const override {
    const Layout ql = q_layout(s, n);
    const int64_t e = element_bytes(dtype);
    const int64_t a = element_bytes(kernels::accumulation_dtype(dtype));
    // Per query block j: |Q_j| = B·S_j·Hq·D·e, |lse_j| = |delta_j| = B·Hq·S_j·a.
    auto qb = [&](int j) { return s.batch * ql.local_size(j) * s.hq * s.head_dim; };
    auto lb = [&](int j) { return s.batch * s.hq * ql.local_size(j); };
    Volume v;
    if (n == 1) return v;
    for (int step = 0; step + 1 < n; ++step) {  // the rotating bundle: n−1 hops
      const int held = (r - step + n) % n, got = (r - step - 1 + 2 * n) % n;
      if (!backward) {
        v.sent += qb(held) * e;
        v.received += qb(got) * e;
      } else {  // Q and dO (input dtype), lse and delta (accumulation dtype)
        v.sent += 2 * qb(held) * e + 2 * lb(held) * a;
        v.received += 2 * qb(got) * e + 2 * lb(got) * a;
      }
    }
    for (int j = 0; j < n; ++j) {  // running O+lse (forward) or dQ (backward): n hops
      const int64_t b = backward ? qb(j) * a : (qb(j) + lb(j)) * a;
      v.sent += b;
      v.received += b;
    }
    return v;
  }
};

}  // namespace

std::unique_ptr<Strategy> make_lv_xattn() { return std::make_unique<LvXAttnStrategy>(); }

}  // namespace lvx::attention
