// ring and striped: Q stationary, K/V rotate to the next rank each round (BurstAttention Alg. 1,
// NOTES.md §2.2); the next block is posted before the current one is computed, so the transfer
// overlaps the compute. Backward (NOTES.md §7.7): K and V rotate again, each block travelling
// with its fp32 dK/dV accumulator, which is sent on while the next block computes and arrives
// home after n hops; dQ accumulates locally.
// striped is the same algorithm over the striped layout (Brandon et al. §3): with the causal
// mask expressed through global positions, every round's block is about half visible on every
// rank, and the kernel skips the invisible tiles.
#include <limits>

#include "src/attention/strategy.h"
#include "src/common/error.h"

namespace lvx::attention {
namespace {

using dist::P2POp;

// Posts one ring step for a block pair (sends a and b to next; receives the block of `incoming_len`
// tokens from prev into *a_next, *b_next) and returns without waiting.
dist::Work rotate(dist::ProcessGroup& pg, const at::Tensor& a, const at::Tensor& b,
                  int64_t incoming_len, at::Tensor* a_next, at::Tensor* b_next, const char* what) {
  auto shape = a.sizes().vec();
  shape[1] = incoming_len;
  *a_next = at::empty(shape, a.options());
  *b_next = at::empty(shape, b.options());
  return pg.batch_isend_irecv({P2POp::send(a, pg.next()), P2POp::send(b, pg.next()),
                               P2POp::recv(*a_next, pg.prev()), P2POp::recv(*b_next, pg.prev())},
                              what);
}

class RingStrategy : public Strategy {
 public:
  StrategyKind kind() const override { return StrategyKind::kRing; }

  LocalOutput forward(dist::ProcessGroup& pg, const AttentionSpec& s,
                      const LocalInputs& in) override {
    const int n = pg.world_size(), r = pg.rank();
    const Layout ql = q_layout(s, n), kl = kv_layout(s, n);
    const at::Tensor q_pos = ql.positions(r);
    const auto acc = kernels::accumulation_dtype(in.q.scalar_type());
    LocalOutput out{at::zeros(in.q.sizes(), in.q.options().dtype(acc)),
                    at::full({s.batch, s.hq, in.q.size(1)},
                             -std::numeric_limits<double>::infinity(),
                             in.q.options().dtype(acc))};
    at::Tensor k = in.k, v = in.v;
    int owner = r;
    for (int step = 0; step < n; ++step) {
      const int next_owner = (owner - 1 + n) % n;
      dist::Work prefetch;
      at::Tensor k_next, v_next;
      if (step + 1 < n)
        prefetch = rotate(pg, k, v, kl.local_size(next_owner), &k_next, &v_next, "ring forward K/V");
      if (k.size(1) > 0 && in.q.size(1) > 0) {
        auto part = kernels::attention_forward(in.q, k, v,
                                               block_params(s, in, q_pos, kl.positions(owner)));
        kernels::merge_attention_states(out.o, out.lse, part.o, part.lse);
      }
      if (step + 1 < n) {
        prefetch.wait();
        k = k_next;
        v = v_next;
        owner = next_owner;
      }
    }
    return out;
  }

  LocalGrads backward(dist::ProcessGroup& pg, const AttentionSpec& s, const LocalInputs& in,
                      const at::Tensor& o, const at::Tensor& lse,
                      const at::Tensor& dout) override {
    const int n = pg.world_size(), r = pg.rank();
    const Layout ql = q_layout(s, n), kl = kv_layout(s, n);
    const at::Tensor q_pos = ql.positions(r);
    const auto acc = kernels::accumulation_dtype(in.q.scalar_type());
    const at::Tensor delta = kernels::attention_delta(dout, o);
    at::Tensor dq = at::zeros(in.q.sizes(), in.q.options().dtype(acc));
    at::Tensor k = in.k, v = in.v;
    int owner = r;
    // dk/dv accumulators of the block held at this step: `acc_in` arrives from prev while this
    // rank computes its own contribution, which is added before sending the sum on.
    dist::Work acc_exchange;
    at::Tensor dk_in, dv_in;
    for (int step = 0; step < n; ++step) {
      const int next_owner = (owner - 1 + n) % n;
      dist::Work prefetch;
      at::Tensor k_next, v_next;
      if (step + 1 < n)
        prefetch = rotate(pg, k, v, kl.local_size(next_owner), &k_next, &v_next, "ring backward K/V");
      at::Tensor dk_part, dv_part;  // this rank's contribution to the held block's dK/dV
      if (k.size(1) > 0 && in.q.size(1) > 0) {
        auto g = kernels::attention_backward(in.q, k, v, dout, lse, delta,
                                             block_params(s, in, q_pos, kl.positions(owner)));
        dq.add_(g.dq);
        dk_part = g.dk;
        dv_part = g.dv;
      } else {
        dk_part = at::zeros(k.sizes(), k.options().dtype(acc));
        dv_part = at::zeros(k.sizes(), k.options().dtype(acc));
      }
      if (step > 0) {
        acc_exchange.wait();
        dk_part.add_(dk_in);
        dv_part.add_(dv_in);
      }
      if (n == 1) return {dq, dk_part, dv_part};
      // Send this block's accumulators on (the last hop takes them home) and receive those of
      // the block held next (after the last step: this rank's own, complete).
      const int incoming = step + 1 < n ? next_owner : r;
      acc_exchange = rotate(pg, dk_part, dv_part, kl.local_size(incoming), &dk_in, &dv_in,
                            "ring backward dK/dV");
      if (step + 1 < n) {
        prefetch.wait();
        k = k_next;
        v = v_next;
        owner = next_owner;
      }
    }
    acc_exchange.wait();
    return {dq, dk_in, dv_in};
  }

  Volume analytic_bytes(const AttentionSpec& s, int n, int r, at::ScalarType dtype,
                        bool backward) const override {
    const Layout kl = kv_layout(s, n);
    const int64_t e = element_bytes(dtype);
    const int64_t a = element_bytes(kernels::accumulation_dtype(dtype));
    auto kv = [&](int j, int64_t bytes) { return 2 * s.batch * kl.local_size(j) * s.hkv * s.head_dim * bytes; };
    Volume v;
    for (int step = 0; step + 1 < n; ++step) {  // K/V: n−1 hops, the block held at each step
      v.sent += kv((r - step + n) % n, e);
      v.received += kv((r - step - 1 + 2 * n) % n, e);
    }
    if (backward && n > 1)
      for (int j = 0; j < n; ++j) {  // dK/dV accumulators of every block pass through once
        v.sent += kv(j, a);
        v.received += kv(j, a);
      }
    return v;
  }
};

class StripedStrategy : public RingStrategy {
 public:
  StrategyKind kind() const override { return StrategyKind::kStriped; }
  Layout q_layout(const AttentionSpec& s, int world) const override {
    return Layout{LayoutKind::kStriped, s.sq, world};
  }
  Layout kv_layout(const AttentionSpec& s, int world) const override {
    return Layout{LayoutKind::kStriped, s.skv, world};
  }
};

}  // namespace

std::unique_ptr<Strategy> make_ring() { return std::make_unique<RingStrategy>(); }
std::unique_ptr<Strategy> make_striped() { return std::make_unique<StripedStrategy>(); }

}  // namespace lvx::attention
