#include "src/planner/cost_model.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "kernels/mask.h"
#include "kernels/registry.h"
#include "src/common/dtype.h"
#include "src/common/error.h"

namespace lvx::planner {

// ---- visible pairs ------------------------------------------------------------------------

PairCounter::PairCounter(MaskRule rule, int64_t sq, int64_t skv, at::Tensor q_media,
                         at::Tensor kv_media)
    : rule_(rule),
      sq_(sq),
      skv_(skv),
      q_media_(std::move(q_media)),
      kv_media_(std::move(kv_media)) {
  if (rule == MaskRule::kMediaImmediate || rule == MaskRule::kMediaUpTo) {
    LVX_CHECK(
        q_media_.defined() && kv_media_.defined() && q_media_.sizes() == at::IntArrayRef({1, sq}) &&
            kv_media_.sizes() == at::IntArrayRef({1, skv}),
        "pair counter: a media layer needs q_media [1, ", sq, "] and kv_media [1, ", skv, "]");
  }
}

int64_t PairCounter::count(const at::Tensor& q_pos, const at::Tensor& k_pos) {
  return kernels::visible_pairs(mask_for(q_pos, k_pos), 1, q_pos.numel(), k_pos.numel());
}

PairCounter::BlockKey PairCounter::block_key(const attention::Layout& ql, int q_block,
                                             const attention::Layout& kl, int kv_block) {
  return std::make_tuple(static_cast<int>(ql.kind) * 1000 + ql.world, q_block,
                         static_cast<int>(kl.kind) * 1000 + kl.world, kv_block);
}

std::pair<at::Tensor, at::Tensor> PairCounter::block_positions(const attention::Layout& ql,
                                                               int q_block,
                                                               const attention::Layout& kl,
                                                               int kv_block) const {
  return {q_block < 0 ? at::arange(sq_, at::kLong) : ql.positions(q_block),
          kv_block < 0 ? at::arange(skv_, at::kLong) : kl.positions(kv_block)};
}

PairCounter::Tiles PairCounter::tiles(const attention::Layout& ql, int q_block,
                                      const attention::Layout& kl, int kv_block) {
  const BlockKey key = block_key(ql, q_block, kl, kv_block);
  auto it = tiles_memo_.find(key);
  if (it != tiles_memo_.end()) return it->second;
  const auto [qp, kp] = block_positions(ql, q_block, kl, kv_block);
  Tiles t;
  const int64_t nq = qp.numel(), nk = kp.numel();
  if (nq == 0 || nk == 0) return tiles_memo_[key] = t;
  if (rule_ == MaskRule::kNone) {
    t.full = kernels::cpu_tiles(nq, nk);
    return tiles_memo_[key] = t;
  }
  const kernels::PreparedMask pm = kernels::prepare_mask(
      mask_for(qp, kp), 1, nq, nk, kernels::kCpuQTile, kernels::kCpuKTile, at::Device(at::kCPU));
  for (int64_t qt = 0; qt < pm.n_q_tiles; ++qt) {
    const kernels::TileSummary qs = pm.q_summary(0, qt);
    for (int64_t kt = 0; kt < pm.n_k_tiles; ++kt) {
      const auto v = kernels::classify_tile(pm.view.kind, pm.view.rule, qs, pm.k_summary(0, kt));
      t.partial += v == kernels::TileVisibility::kPartial;
      t.full += v == kernels::TileVisibility::kFull;
    }
  }
  return tiles_memo_[key] = t;
}

kernels::AttentionMask PairCounter::mask_for(const at::Tensor& q_pos,
                                             const at::Tensor& k_pos) const {
  kernels::AttentionMask m;
  switch (rule_) {
    case MaskRule::kNone:
      break;
    case MaskRule::kCausal:
      m.kind = kernels::MaskKind::kCausal;
      m.q_pos = q_pos + (skv_ - sq_);
      m.k_pos = k_pos;
      break;
    case MaskRule::kMediaImmediate:
    case MaskRule::kMediaUpTo:
      m.kind = kernels::MaskKind::kMedia;
      m.media_rule = rule_ == MaskRule::kMediaUpTo ? kernels::MediaRule::kUpTo
                                                   : kernels::MediaRule::kImmediate;
      m.q_media = q_media_.index_select(1, q_pos);
      m.kv_media = kv_media_.index_select(1, k_pos);
      break;
  }
  return m;
}

int64_t PairCounter::count(const attention::Layout& ql, int q_block, const attention::Layout& kl,
                           int kv_block) {
  const BlockKey key = block_key(ql, q_block, kl, kv_block);
  auto it = memo_.find(key);
  if (it != memo_.end()) return it->second;
  const auto [qp, kp] = block_positions(ql, q_block, kl, kv_block);
  return memo_[key] = count(qp, kp);
}

int64_t PairCounter::total() {
  const attention::Layout whole_q{attention::LayoutKind::kContiguous, sq_, 1};
  const attention::Layout whole_k{attention::LayoutKind::kContiguous, skv_, 1};
  return count(whole_q, -1, whole_k, -1);
}

PairCounter& LayerWorkload::counter() const {
  LVX_CHECK(pairs != nullptr || mask == MaskRule::kNone || mask == MaskRule::kCausal,
            "layer workload: a media layer needs its mask metadata (PairCounter)");
  if (!pairs) pairs = std::make_shared<PairCounter>(mask, sq, skv);
  return *pairs;
}

double LayerWorkload::density() const {
  if (sq == 0 || skv == 0) return 0;
  return static_cast<double>(counter().total()) /
         (static_cast<double>(sq) * static_cast<double>(skv));
}

// ---- sizes --------------------------------------------------------------------------------

namespace {

int64_t kv_heads_moved(const LayerWorkload& w, const CostOptions& opt) {
  return opt.expand_kv_heads ? w.heads : w.kv_heads;
}

}  // namespace

CostOptions paper_accounting(CostOptions base) {
  base.expand_kv_heads = true;
  base.skip_masked_tiles = false;
  base.topology_aware_ring = false;
  return base;
}

attention::AttentionSpec layer_spec(const LayerWorkload& w, const CostOptions& opt) {
  attention::AttentionSpec s;
  s.batch = 1;
  s.sq = w.sq;
  s.skv = w.skv;
  s.hq = w.heads;
  s.hkv = kv_heads_moved(w, opt);
  s.head_dim = w.head_dim;
  s.mask = w.mask == MaskRule::kNone     ? kernels::MaskKind::kNone
           : w.mask == MaskRule::kCausal ? kernels::MaskKind::kCausal
                                         : kernels::MaskKind::kMedia;
  s.media_rule =
      w.mask == MaskRule::kMediaUpTo ? kernels::MediaRule::kUpTo : kernels::MediaRule::kImmediate;
  // A cross layer's queries are the text, in the text's layout (strategies that choose their own
  // layouts, striped and distflash, override it); its keys are whole frames striped across the
  // ranks, as the runtime holds them (models::media_layout).
  if (w.kind == LayerKind::kCross) {
    s.q_layout = opt.text_layout;
    s.kv_layout = attention::LayoutKind::kStriped;
    s.kv_unit = w.kv_unit;
  }
  return s;
}

attention::AttentionSpec layer_spec(const LayerWorkload& w, const ClusterConfig& c,
                                    const CostOptions& opt) {
  attention::AttentionSpec s = layer_spec(w, opt);
  s.node_size = opt.topology_aware_ring ? c.gpus_per_node : 0;  // double ring across nodes
  return s;
}

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

// ---- links --------------------------------------------------------------------------------

Link ring_link(const ClusterConfig& c, int64_t n) {
  return n > c.gpus_per_node ? c.inter_node : c.intra_node;
}

double transfer_time(const Link& l, double bytes) {
  return bytes > 0 ? l.latency_s + bytes / l.bandwidth_bytes_per_s : 0.0;
}

double all_to_all_time(const ClusterConfig& c, int64_t n, double bytes_sent) {
  if (n <= 1 || bytes_sent <= 0) return 0;
  const int64_t local = std::min(n, c.gpus_per_node);
  const double chunk = bytes_sent / static_cast<double>(n - 1);
  double intra = transfer_time(c.intra_node, chunk * static_cast<double>(local - 1));
  // Every GPU of a node sends (n - local) chunks off the node through the node's shared link.
  double inter = transfer_time(c.inter_node, chunk * static_cast<double>((n - local) * local));
  return std::max(intra, inter);
}

// ---- one pass from the strategy's schedules -----------------------------------------------

namespace {

struct PassCost {
  double time_s = 0, compute_s = 0, comm_s = 0, bytes_sent = 0;
};

double message_time(const attention::Message& m, const ClusterConfig& c, int64_t n,
                    const Link& link) {
  switch (m.op) {
    case attention::Message::kRingHop:
      return transfer_time(link, static_cast<double>(m.sent));
    // Blocking collectives wait for every peer once (Link::sync_s), then move their bytes.
    case attention::Message::kAllToAll:
      return n > 1 ? link.sync_s + all_to_all_time(c, n, static_cast<double>(m.sent)) : 0;
    case attention::Message::kAllGatherRing:
      return n > 1 ? link.sync_s + static_cast<double>(n - 1) *
                                       transfer_time(link, static_cast<double>(m.sent) /
                                                               static_cast<double>(n - 1))
                   : 0;
  }
  return 0;
}

// The constants a pass is priced with: its direction's kernel rates, the layouts, the links.
struct PassContext {
  const attention::AttentionSpec& spec;
  const LayerWorkload& w;
  const ClusterConfig& c;
  const CostOptions& opt;
  int n;
  double flops_per_pair, rate, tile_s, mask_s, call_s;
  attention::Layout ql, kl;
  Link link;  // collectives' ring hops
  int64_t per_node;
  bool same_node(int a, int b) const { return a / per_node == b / per_node; }
};

// Reads the rates of the pass's direction (forward or backward), the layouts and the links.
PassContext pass_context(const attention::Strategy& st, const attention::AttentionSpec& spec,
                         const LayerWorkload& w, const ClusterConfig& c, int n, bool backward,
                         const CostOptions& opt) {
  const AttentionThroughput& thr = c.attention_for(w.dtype);
  const double flops_per_pair = (backward ? 10.0 : 4.0) * static_cast<double>(spec.head_dim);
  const double rate = backward ? thr.backward_flops : thr.forward_flops;
  const double tile_s = backward ? thr.backward_tile_s : thr.forward_tile_s;
  const double mask_s = backward ? thr.backward_masked_tile_s : thr.forward_masked_tile_s;
  const double call_s = backward ? thr.backward_call_s : thr.forward_call_s;
  const attention::Layout ql = st.q_layout(spec, n), kl = st.kv_layout(spec, n);
  const Link link = ring_link(c, n);  // collectives' ring hops
  const int64_t per_node = std::max<int64_t>(1, c.gpus_per_node);
  return {spec, w, c, opt, n, flops_per_pair, rate, tile_s, mask_s, call_s, ql, kl, link, per_node};
}

// What every rank's schedule puts on its compute and on the links, per round.
struct PassTally {
  PassTally(int n, int64_t nodes)
      : rank_compute(n, 0),
        f(n),
        intra_bytes(n),
        node_inter(nodes),
        long_intra(n),
        long_inter(nodes) {}
  std::vector<double> rank_compute;  // compute per rank
  // Per rank (node_inter: per node) and round: compute, intra-node bytes, inter-node bytes.
  std::vector<std::vector<double>> f, intra_bytes, node_inter;
  // Bytes of messages that overlap several rounds, per (first round, span).
  std::vector<std::map<std::pair<int, int>, double>> long_intra, long_inter;
};

// Rank r's compute time in each of its rounds (f[r]) and in all of them (rank_compute[r]).
void add_rank_compute(const PassContext& x, const attention::PassSchedule& p, int r, size_t rounds,
                      PassTally& tally) {
  for (size_t t = 0; t < rounds; ++t) {
    const attention::Block& b = p.rounds[t];
    if (b.idle()) continue;
    const int64_t q_len = b.q < 0 ? x.spec.sq : x.ql.local_size(b.q);
    const int64_t k_len = b.kv < 0 ? x.spec.skv : x.kl.local_size(b.kv);
    const double pairs = x.opt.skip_masked_tiles
                             ? static_cast<double>(x.w.counter().count(x.ql, b.q, x.kl, b.kv))
                             : static_cast<double>(q_len) * static_cast<double>(k_len);
    const double heads = static_cast<double>(x.spec.hq / p.head_divisor);
    PairCounter::Tiles tl;
    if (x.tile_s > 0 || x.mask_s > 0) tl = x.w.counter().tiles(x.ql, b.q, x.kl, b.kv);
    tally.f[r][t] = pairs * heads * x.flops_per_pair / x.rate +
                    heads * (static_cast<double>(tl.full + tl.partial) * x.tile_s +
                             static_cast<double>(tl.partial) * x.mask_s) +
                    (q_len > 0 && k_len > 0 ? x.call_s : 0.0);
    tally.rank_compute[r] += tally.f[r][t];
  }
}

// Rank r's messages: returns its collectives' time; adds the others' bytes by link and round.
double add_rank_messages(const PassContext& x, const attention::PassSchedule& p, int r,
                         int64_t node, PassTally& tally) {
  double sequential = 0;
  for (const attention::Message& m : p.messages) {
    if (m.round < 0) {
      sequential += message_time(m, x.c, x.n, x.link);
      continue;
    }
    // A point-to-point message is priced on the link between its two ranks; one without a
    // peer on the ring's slowest link.
    const bool intra = m.peer >= 0 ? x.same_node(r, m.peer) : x.n <= x.per_node;
    const double bytes = static_cast<double>(m.sent);
    if (m.span > 1) {
      (intra ? tally.long_intra[r] : tally.long_inter[node])[{m.round, m.span}] += bytes;
    } else if (intra) {
      tally.intra_bytes[r][static_cast<size_t>(m.round)] += bytes;
    } else {
      tally.node_inter[node][static_cast<size_t>(m.round)] += bytes;
    }
  }
  return sequential;
}

// Every rank's compute and link bytes per round; into `out` the max collectives and bytes.
PassTally tally_ranks(const PassContext& x, const std::vector<attention::PassSchedule>& sched,
                      size_t rounds, PassCost& out) {
  // A node's inter-node link is shared by its ranks (cluster_config.h: inter_node bandwidth is per
  // node): the bytes every rank of a node sends across nodes in a round (or a span) go through it
  // together. Measured on an emulated cluster (docs/cluster.md): pricing each rank as if it had
  // the node's link to itself predicted ring at 0.41x its time on 2 nodes x 2 ranks.
  const int64_t nodes = (x.n + x.per_node - 1) / x.per_node;
  PassTally tally(x.n, nodes);
  for (int r = 0; r < x.n; ++r) {
    const attention::PassSchedule& p = sched[r];
    const int64_t node = r / x.per_node;
    tally.f[r].assign(rounds + 1, 0);
    tally.intra_bytes[r].assign(rounds + 1, 0);
    tally.node_inter[node].resize(rounds + 1, 0);
    add_rank_compute(x, p, r, rounds, tally);
    const double sequential = add_rank_messages(x, p, r, node, tally);
    out.comm_s = std::max(out.comm_s, sequential);  // collectives: every rank's are alike
    out.bytes_sent = std::max(out.bytes_sent, static_cast<double>(p.volume().sent));
  }
  return tally;
}

// The slowest rank's times, per round and per span.
struct RoundTimes {
  // per round: the slowest rank's max(compute, overlapped communication).
  std::vector<double> round_time, round_comm;
  // Messages that overlap several rounds (a double ring's inter-node hops): the slowest rank's
  // time per (first round, span).
  std::map<std::pair<int, int>, double> spanned;
};

// Per round: the slowest rank's max(compute, its intra-node link, its node's shared link).
RoundTimes round_times(const PassContext& x, const PassTally& tally, size_t rounds) {
  RoundTimes rt{std::vector<double>(rounds + 1, 0), std::vector<double>(rounds + 1, 0), {}};
  for (int r = 0; r < x.n; ++r) {
    const int64_t node = r / x.per_node;
    for (size_t t = 0; t <= rounds; ++t) {
      const double comm = std::max(transfer_time(x.c.intra_node, tally.intra_bytes[r][t]),
                                   transfer_time(x.c.inter_node, tally.node_inter[node][t]));
      rt.round_time[t] = std::max(rt.round_time[t], std::max(tally.f[r][t], comm));
      rt.round_comm[t] = std::max(rt.round_comm[t], comm);
    }
    std::map<std::pair<int, int>, double> keys = tally.long_intra[r];
    for (const auto& [key, bytes] : tally.long_inter[node]) keys[key] += 0;
    for (const auto& [key, unused] : keys) {
      const auto in = tally.long_intra[r].find(key);
      const auto across = tally.long_inter[node].find(key);
      const double tm =
          std::max(transfer_time(x.c.intra_node, in == tally.long_intra[r].end() ? 0 : in->second),
                   transfer_time(x.c.inter_node,
                                 across == tally.long_inter[node].end() ? 0 : across->second));
      rt.spanned[key] = std::max(rt.spanned[key], tm);
    }
  }
  return rt;
}

// The pass's compute, time and communication: summed over rounds when messages overlap compute.
void add_round_times(PassCost& out, const attention::PassSchedule& first,
                     const std::vector<double>& rank_compute, RoundTimes& rt, size_t rounds) {
  const bool overlapped = std::any_of(first.messages.begin(), first.messages.end(),
                                      [](const attention::Message& m) { return m.round >= 0; }) ||
                          first.messages.empty();
  out.compute_s = *std::max_element(rank_compute.begin(), rank_compute.end());
  if (overlapped) {
    // A message spanning rounds [t0, t0 + span) is hidden while those rounds take longer; the
    // rest of it delays the last of them.
    for (const auto& [key, tm] : rt.spanned) {
      const size_t t0 = static_cast<size_t>(key.first);
      const size_t t1 = std::min(rt.round_time.size(), t0 + static_cast<size_t>(key.second));
      double covered = 0;
      for (size_t t = t0; t < t1; ++t) covered += rt.round_time[t];
      if (tm > covered) rt.round_time[t1 - 1] += tm - covered;
      out.comm_s += tm;
    }
    for (size_t t = 0; t <= rounds; ++t) {
      out.time_s += rt.round_time[t];
      out.comm_s += rt.round_comm[t];
    }
  } else {
    out.time_s = out.comm_s + out.compute_s;
  }
}

PassCost pass_cost(const attention::Strategy& st, const attention::AttentionSpec& spec,
                   const LayerWorkload& w, const ClusterConfig& c, int n, bool backward,
                   const CostOptions& opt) {
  const PassContext x = pass_context(st, spec, w, c, n, backward, opt);
  const at::ScalarType dtype = dtype_of(w.dtype, "workload dtype");

  std::vector<attention::PassSchedule> sched;
  for (int r = 0; r < n; ++r) sched.push_back(st.schedule(spec, n, r, dtype, backward));
  const size_t rounds = sched[0].rounds.size();
  PassCost out;
  const PassTally tally = tally_ranks(x, sched, rounds, out);
  RoundTimes rt = round_times(x, tally, rounds);
  add_round_times(out, sched[0], tally.rank_compute, rt, rounds);
  return out;
}

// ---- estimate's terms ---------------------------------------------------------------------

// Marks the cost infeasible, with the strategy's reason, when it cannot run `spec`.
void mark_unsupported(StrategyCost& out, const attention::Strategy& strategy,
                      const attention::AttentionSpec& spec, int world) {
  try {
    strategy.check_supported(spec, world);
  } catch (const lvx::Error& e) {
    out.feasible = false;
    out.reason = e.what();
  }
}

// Recomputing K/V (and Q) of a cross layer from y and x in the backward (LV-XAttn §3.2).
double recompute_seconds(const LayerWorkload& w, const ClusterConfig& c, double nn) {
  const double kvh = static_cast<double>(w.kv_heads), d = static_cast<double>(w.head_dim);
  const double flops = 2 * (static_cast<double>(w.skv) / nn) *
                           static_cast<double>(w.visual_feature_dim) * 2 * kvh * d +
                       2 * (static_cast<double>(w.sq) / nn) * static_cast<double>(w.hidden_size) *
                           static_cast<double>(w.heads) * d;
  return flops / c.gemm_for(w.dtype);
}

// The forward's (and, training, the backward's) time, compute, communication and bytes sent.
void add_pass_times(StrategyCost& out, const attention::Strategy& strategy,
                    const attention::AttentionSpec& spec, const LayerWorkload& w,
                    const ClusterConfig& c, int world, const CostOptions& opt, bool recompute,
                    double nn) {
  const PassCost f = pass_cost(strategy, spec, w, c, world, false, opt);
  out.fwd_s = f.time_s;
  out.fwd_compute_s = f.compute_s;
  out.fwd_comm_s = f.comm_s;
  out.bytes_sent.forward = f.bytes_sent;
  if (opt.train) {
    const PassCost g = pass_cost(strategy, spec, w, c, world, true, opt);
    double recompute_s = 0;
    if (recompute) recompute_s = recompute_seconds(w, c, nn);
    out.bwd_s = g.time_s + recompute_s;
    out.bwd_compute_s = g.compute_s + recompute_s;
    out.bwd_comm_s = g.comm_s;
    out.bytes_sent.backward = g.bytes_sent;
  }
}

// The working buffers of the forward and of the backward, per strategy.
std::pair<double, double> working_bytes(StrategyKind s, const ShardBytes& b, double in, double nn) {
  double work_f = 0, work_b = 0;
  switch (s) {
    case StrategyKind::kLvXAttn:
      work_f = b.q + 3 * (b.o32 + b.lse);
      work_b = 2 * (b.q + b.lse) + 3 * b.dq32 + b.dk32 + b.dv32;
      break;
    case StrategyKind::kRing:
    case StrategyKind::kStriped:
      work_f = b.k + b.v + b.o32 + b.lse;
      work_b = b.k + b.v + 3 * (b.dk32 + b.dv32) + b.dq32;
      break;
    case StrategyKind::kDistFlash:
      // A fetched K/V block and a helped rank's Q; returned (O, lse) of up to half the rounds.
      work_f = 2 * (b.k + b.v) + b.q + b.o32 + b.lse + nn / 2 * (b.o32 + b.lse);
      work_b = 2 * (b.k + b.v) + 2 * (b.q + b.lse) + b.dq32 + b.dk32 + b.dv32 +
               nn / 2 * (b.dq32 + b.dk32 + b.dv32);
      break;
    case StrategyKind::kUlysses:
      work_f = 2 * (in + b.o) + b.o32;
      work_b = 2 * (in + b.o) + b.dq32 + b.dk32 + b.dv32;
      break;
    case StrategyKind::kAllGather:
      work_f = nn * (b.k + b.v) + b.o32 + b.lse;
      work_b = nn * (b.k + b.v) + nn * (b.dk32 + b.dv32) + b.dq32;
      break;
  }
  return {work_f, work_b};
}

// What the forward saves for the backward, by the strategy's saved form.
double saved_bytes(attention::SavedForm form, const ShardBytes& b, double in, double outb,
                   double nn, bool cross, bool recompute, const CostOptions& opt) {
  double saved = 0;
  switch (form) {
    case attention::SavedForm::kShards:
      // Without recomputation a cross layer also keeps its K/V projection's input (the
      // normalized visual features, skv × visual_feature_dim).
      saved = recompute ? b.x + b.o + b.lse : in + outb + (cross && opt.train ? b.y : 0);
      break;
    case attention::SavedForm::kHeadShards:  // the same amount, sharded by heads
      saved = in + outb + (recompute ? b.x : 0);
      break;
    case attention::SavedForm::kGatheredKV:
      saved = b.q + nn * (b.k + b.v) + outb;
      break;
  }
  return saved;
}

// Memory: inputs, output, working buffers of the larger pass, and what the forward saves (by
// the strategy's saved form).
void add_memory(StrategyCost& out, StrategyKind s, const attention::Strategy& strategy,
                const ShardBytes& b, double nn, bool cross, bool recompute,
                const CostOptions& opt) {
  const double in = b.q + b.k + b.v, outb = b.o + b.lse;
  auto [work_f, work_b] = working_bytes(s, b, in, nn);
  double saved = saved_bytes(strategy.saved_form(), b, in, outb, nn, cross, recompute, opt);
  if (!opt.train) work_b = saved = 0;
  out.mem_bytes = in + outb + std::max(work_f, work_b) + saved;
  out.saved_bytes = saved;
}

// Marks the cost infeasible when its memory exceeds the device's less the reserve.
void mark_over_budget(StrategyCost& out, const ClusterConfig& c, const CostOptions& opt) {
  const double budget = static_cast<double>(c.device_memory_bytes) - opt.reserved_bytes;
  if (out.feasible && out.mem_bytes > budget) {
    out.feasible = false;
    out.reason =
        str("needs ", out.mem_bytes / (1 << 30), " GiB per rank, ", budget / (1 << 30),
            " GiB available (device ", static_cast<double>(c.device_memory_bytes) / (1 << 30),
            " GiB less ", opt.reserved_bytes / (1 << 30), " GiB reserved)");
  }
}

// Whether communication or compute takes longer, over both passes.
void set_bound(StrategyCost& out) {
  const double comm = out.fwd_comm_s + out.bwd_comm_s;
  const double comp = out.fwd_compute_s + out.bwd_compute_s;
  out.bound = comm > comp ? "communication" : "compute";
}

}  // namespace

StrategyCost estimate(StrategyKind s, const LayerWorkload& w, const ClusterConfig& c, int64_t n,
                      const CostOptions& opt) {
  LVX_CHECK(n >= 1 && n <= c.world_size(), "ranks: expected 1..", c.world_size(), " for cluster '",
            c.name, "', got ", n);
  StrategyCost out;
  out.strategy = s;
  const auto strategy = attention::make_strategy(s);
  const attention::AttentionSpec spec = layer_spec(w, c, opt);
  const int world = static_cast<int>(n);
  mark_unsupported(out, *strategy, spec, world);
  const bool cross = w.kind == LayerKind::kCross;
  const bool recompute = opt.train && cross && opt.recompute_cross_kv;
  const double nn = static_cast<double>(n);
  const ShardBytes b = shard_bytes(w, n, opt);
  if (out.feasible) add_pass_times(out, *strategy, spec, w, c, world, opt, recompute, nn);
  add_memory(out, s, *strategy, b, nn, cross, recompute, opt);
  mark_over_budget(out, c, opt);
  set_bound(out);
  return out;
}

}  // namespace lvx::planner
