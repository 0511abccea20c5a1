#include "src/planner/cost_model.h"

#include <algorithm>
#include <vector>

#include "src/common/error.h"

namespace lvx::planner {

const char* to_string(Strategy s) {
  switch (s) {
    case Strategy::kLvXattn:
      return "lv_xattn";
    case Strategy::kRing:
      return "ring";
    case Strategy::kStriped:
      return "striped";
    case Strategy::kUlysses:
      return "ulysses";
    case Strategy::kAllGather:
      return "all_gather";
    case Strategy::kLocal:
      return "local";
  }
  return "?";
}

Strategy strategy_from_string(const std::string& s) {
  for (Strategy k : kAllStrategies) {
    if (s == to_string(k)) return k;
  }
  LVX_FAIL("strategy: expected lv_xattn|ring|striped|ulysses|all_gather|local, got '", s, "'");
}

namespace {

int64_t kv_heads_moved(const LayerWorkload& w, const CostOptions& opt) {
  return opt.expand_kv_heads ? w.heads : w.kv_heads;
}

double density(const LayerWorkload& w, const CostOptions& opt) {
  // Causal structure is handled per strategy (critical path); media masks thin every block.
  if (w.mask == MaskRule::kCausal || !opt.skip_masked_tiles) return 1.0;
  return w.density;
}

// Sum over rounds of max(f_r, comm(a·[r<n-1] + b·[r≥1])) + comm(b): eq. (1)/(2) per round.
double overlapped_rounds(const std::vector<double>& f, const Link& link, double a, double b) {
  const size_t n = f.size();
  double t = 0;
  for (size_t r = 0; r < n; ++r) {
    double bytes = (r + 1 < n ? a : 0) + (r >= 1 ? b : 0);
    t += std::max(f[r], transfer_time(link, bytes));
  }
  return t + (n > 1 ? transfer_time(link, b) : 0);
}

double comm_only_rounds(size_t n, const Link& link, double a, double b) {
  double t = 0;
  for (size_t r = 0; r < n; ++r) {
    t += transfer_time(link, (r + 1 < n ? a : 0) + (r >= 1 ? b : 0));
  }
  return t + (n > 1 ? transfer_time(link, b) : 0);
}

double sum(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s;
}

}  // namespace

ShardBytes shard_bytes(const LayerWorkload& w, int64_t n, const CostOptions& opt) {
  const double sq = static_cast<double>(w.sq) / n, skv = static_cast<double>(w.skv) / n;
  const double e = static_cast<double>(w.elem_bytes);
  const double hq = static_cast<double>(w.heads), d = static_cast<double>(w.head_dim);
  const double hkv = static_cast<double>(kv_heads_moved(w, opt));
  ShardBytes b;
  b.q = sq * hq * d * e;
  b.k = b.v = skv * hkv * d * e;
  b.o = b.q;
  b.o32 = sq * hq * d * 4;
  b.lse = sq * hq * 4;
  b.dq32 = b.o32;
  b.dk32 = b.dv32 = skv * hkv * d * 4;
  b.x = sq * static_cast<double>(w.hidden_size) * e;
  b.y = skv * static_cast<double>(w.visual_feature_dim) * e;
  return b;
}

Volume comm_volume(Strategy s, const ShardBytes& b, int64_t n) {
  const double m = static_cast<double>(n - 1), nn = static_cast<double>(n);
  switch (s) {
    case Strategy::kLvXattn:
      return {m * b.q + nn * (b.o32 + b.lse), m * (b.q + b.q + b.lse + b.lse) + nn * b.dq32};
    case Strategy::kRing:
    case Strategy::kStriped:
      return {m * (b.k + b.v), m * (b.k + b.v) + nn * (b.dk32 + b.dv32)};
    case Strategy::kUlysses:
      // dQ/dK/dV return in the activation dtype (|dQ| = |Q|, |dK| = |K|).
      return {m / nn * (b.q + b.k + b.v + b.o + b.lse), m / nn * (b.q + b.q + b.k + b.v)};
    case Strategy::kAllGather:
      return {m * (b.k + b.v), m * (b.dk32 + b.dv32)};
    case Strategy::kLocal:
      return {m * (b.q + b.k + b.v), m * b.o};
  }
  return {0, 0};
}

Link ring_link(const ClusterConfig& c, int64_t n) {
  return n > c.gpus_per_node ? c.inter_node : c.intra_node;
}

double transfer_time(const Link& l, double bytes) {
  return bytes > 0 ? l.latency_s + bytes / l.bandwidth_bytes_per_s : 0.0;
}

double all_to_all_time(const ClusterConfig& c, int64_t n, double bytes) {
  if (n <= 1 || bytes <= 0) return 0;
  const int64_t local = std::min(n, c.gpus_per_node);
  const double chunk = bytes / static_cast<double>(n);
  double intra = transfer_time(c.intra_node, chunk * static_cast<double>(local - 1));
  // Every GPU of a node sends (n - local) chunks off the node through the node's shared link.
  double inter = transfer_time(c.inter_node, chunk * static_cast<double>((n - local) * local));
  return std::max(intra, inter);
}

StrategyCost estimate(Strategy s, const LayerWorkload& w, const ClusterConfig& c, int64_t n,
                      const CostOptions& opt) {
  LVX_CHECK(n >= 1 && n <= c.world_size(), "ranks: expected 1..", c.world_size(), " for cluster '",
            c.name, "', got ", n);
  StrategyCost out;
  out.strategy = s;
  const AttentionThroughput& thr = c.attention_for(w.dtype);
  const ShardBytes b = shard_bytes(w, n, opt);
  out.bytes_sent = comm_volume(s, b, n);
  const bool causal = w.mask == MaskRule::kCausal;
  const bool cross = w.kind == LayerKind::kCross;
  const double rho = density(w, opt);
  const double nn = static_cast<double>(n);
  // One full (sq x skv) block.
  const double pair = static_cast<double>(w.sq) / nn * (static_cast<double>(w.skv) / nn) *
                      static_cast<double>(w.heads) * static_cast<double>(w.head_dim);
  const double blk_f = 4 * pair * rho / thr.forward_flops;
  const double blk_b = 10 * pair * rho / thr.backward_flops;
  const Link link = ring_link(c, n);

  // Per-round compute on the critical path, in blocks.
  std::vector<double> blocks(static_cast<size_t>(n), 1.0);
  if (causal) {
    if (s == Strategy::kStriped) {
      std::fill(blocks.begin(), blocks.end(), 0.5);
    } else {
      blocks[0] = 0.5;  // contiguous: the diagonal block, then full blocks on the last rank
    }
  }
  const double total_blocks = sum(blocks);  // blocks of the busiest rank
  auto scaled = [&](double per_block) {
    std::vector<double> f(blocks.size());
    for (size_t i = 0; i < f.size(); ++i) f[i] = blocks[i] * per_block;
    return f;
  };

  // Recomputing K/V (and Q) of a cross layer from y and x in the backward (LV-XAttn §3.2).
  double recompute_s = 0;
  if (opt.train && cross && opt.recompute_cross_kv) {
    const double kvh = static_cast<double>(w.kv_heads), d = static_cast<double>(w.head_dim);
    double flops = 2 * (static_cast<double>(w.skv) / nn) *
                       static_cast<double>(w.visual_feature_dim) * 2 * kvh * d +
                   2 * (static_cast<double>(w.sq) / nn) * static_cast<double>(w.hidden_size) *
                       static_cast<double>(w.heads) * d;
    if (s == Strategy::kLocal) flops *= nn;
    recompute_s = flops / c.gemm_for(w.dtype);
  }

  double work_f = 0, work_b = 0, saved = 0;
  const double in = b.q + b.k + b.v, outb = b.o + b.lse;
  const bool recompute = opt.train && cross && opt.recompute_cross_kv;
  const double saved_seq = recompute ? b.x + b.o + b.lse : b.q + b.k + b.v + b.o + b.lse;
  switch (s) {
    case Strategy::kLvXattn: {
      const double a_f = b.q, b_f = b.o32 + b.lse;
      const double a_b = b.q + b.q + b.lse + b.lse, b_b = b.dq32;
      out.fwd_s = overlapped_rounds(scaled(blk_f), link, a_f, b_f);
      out.bwd_s = overlapped_rounds(scaled(blk_b), link, a_b, b_b);
      out.fwd_comm_s = comm_only_rounds(blocks.size(), link, a_f, b_f);
      out.bwd_comm_s = comm_only_rounds(blocks.size(), link, a_b, b_b);
      out.fwd_compute_s = total_blocks * blk_f;
      out.bwd_compute_s = total_blocks * blk_b;
      work_f = b.q + 3 * (b.o32 + b.lse);
      work_b = a_b + 3 * b.dq32 + b.dk32 + b.dv32;
      saved = saved_seq;
      break;
    }
    case Strategy::kRing:
    case Strategy::kStriped: {
      const double a = b.k + b.v, b_b = b.dk32 + b.dv32;
      out.fwd_s = overlapped_rounds(scaled(blk_f), link, a, 0);
      out.bwd_s = overlapped_rounds(scaled(blk_b), link, a, b_b);
      out.fwd_comm_s = comm_only_rounds(blocks.size(), link, a, 0);
      out.bwd_comm_s = comm_only_rounds(blocks.size(), link, a, b_b);
      out.fwd_compute_s = total_blocks * blk_f;
      out.bwd_compute_s = total_blocks * blk_b;
      work_f = a + b.o32 + b.lse;
      work_b = a + 3 * b_b + b.dq32;
      saved = saved_seq;
      break;
    }
    case Strategy::kUlysses: {
      if (w.heads % n != 0 || kv_heads_moved(w, opt) % n != 0) {
        out.feasible = false;
        out.reason = str("heads cannot be split: Hq=", w.heads, ", Hkv=", kv_heads_moved(w, opt),
                         " not both divisible by ", n, " ranks");
      }
      // The whole sequence on Hq/n heads: n blocks' worth of pairs, half of them when causal.
      const double blocks_u = causal ? nn / 2 : nn;
      out.fwd_compute_s = blocks_u * blk_f;
      out.bwd_compute_s = blocks_u * blk_b;
      // One all-to-all per tensor (src/attention/ulysses.cpp), each paying its latency.
      out.fwd_comm_s = all_to_all_time(c, n, b.q) + all_to_all_time(c, n, b.k) +
                       all_to_all_time(c, n, b.v) + all_to_all_time(c, n, b.o) +
                       all_to_all_time(c, n, b.lse);
      out.bwd_comm_s = all_to_all_time(c, n, b.q) + all_to_all_time(c, n, b.q) +
                       all_to_all_time(c, n, b.k) + all_to_all_time(c, n, b.v);
      out.fwd_s = out.fwd_compute_s + out.fwd_comm_s;
      out.bwd_s = out.bwd_compute_s + out.bwd_comm_s;
      work_f = 2 * (in + b.o) + b.o32;
      work_b = 2 * (in + b.o) + b.dq32 + b.dk32 + b.dv32;
      saved = b.q + b.k + b.v + b.o + b.lse + (recompute ? b.x : 0);
      break;
    }
    case Strategy::kAllGather: {
      // K and V are gathered one after the other, each a ring of n-1 steps; dK and dV are
      // reduce-scattered one after the other as pairwise all-to-alls of the full fp32 gradient
      // (src/attention/all_gather.cpp).
      const double a = b.k + b.v;
      out.fwd_comm_s = (nn - 1) * (transfer_time(link, b.k) + transfer_time(link, b.v));
      out.bwd_comm_s = all_to_all_time(c, n, nn * b.dk32) + all_to_all_time(c, n, nn * b.dv32);
      out.fwd_compute_s = total_blocks * blk_f;
      out.bwd_compute_s = total_blocks * blk_b;
      out.fwd_s = out.fwd_comm_s + out.fwd_compute_s;
      out.bwd_s = out.bwd_comm_s + out.bwd_compute_s;
      work_f = nn * a + b.o32 + b.lse;
      work_b = nn * a + nn * (b.dk32 + b.dv32) + b.dq32;
      saved = b.q + nn * a + b.o + b.lse;
      break;
    }
    case Strategy::kLocal: {
      // Every rank runs the whole layer. Inside a sequence-sharded model that first needs the
      // other ranks' q, k, v (and dO in the backward): ring all-gathers, not overlapped. Each
      // rank then keeps its own rows of o and of the gradients (no reduction).
      const double blocks_l = causal ? nn * nn / 2 : nn * nn;
      out.fwd_compute_s = blocks_l * blk_f;
      out.bwd_compute_s = blocks_l * blk_b;
      out.fwd_comm_s = (nn - 1) * (transfer_time(link, b.q) + transfer_time(link, b.k) +
                                   transfer_time(link, b.v));
      out.bwd_comm_s = (nn - 1) * transfer_time(link, b.o);
      out.fwd_s = out.fwd_compute_s + out.fwd_comm_s;
      out.bwd_s = out.bwd_compute_s + out.bwd_comm_s;
      // Everything is whole: n times the shard sizes.
      work_f = nn * (b.o32 + b.lse);
      work_b = nn * (b.dq32 + b.dk32 + b.dv32);
      saved = nn * saved_seq;
      out.mem_bytes = nn * (in + outb);
      break;
    }
  }
  out.bwd_s += recompute_s;
  out.bwd_compute_s += recompute_s;
  if (!opt.train) {
    out.bwd_s = out.bwd_compute_s = out.bwd_comm_s = 0;
    out.bytes_sent.backward = 0;
    work_b = 0;
    saved = 0;
  }
  if (s != Strategy::kLocal) out.mem_bytes = in + outb;
  out.mem_bytes += std::max(work_f, work_b) + saved;
  out.saved_bytes = saved;
  const double budget = static_cast<double>(c.device_memory_bytes) - opt.reserved_bytes;
  if (out.feasible && out.mem_bytes > budget) {
    out.feasible = false;
    out.reason =
        str("needs ", out.mem_bytes / (1 << 30), " GiB per rank, ", budget / (1 << 30),
            " GiB available (device ", static_cast<double>(c.device_memory_bytes) / (1 << 30),
            " GiB less ", opt.reserved_bytes / (1 << 30), " GiB reserved)");
  }
  if (n == 1 && s != Strategy::kLocal && out.feasible) {
    out.feasible = false;
    out.reason = "one rank: nothing to distribute (use local)";
  }
  const double comm = out.fwd_comm_s + out.bwd_comm_s;
  const double comp = out.fwd_compute_s + out.bwd_compute_s;
  out.bound = comm > comp ? "communication" : "compute";
  return out;
}

}  // namespace lvx::planner
