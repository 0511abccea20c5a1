#include "src/attention/strategy.h"

#include <cmath>
#include <limits>
#include <tuple>

#include "src/common/error.h"

namespace lvx::attention {

namespace {
struct NameEntry {
  StrategyKind kind;
  const char* name;
};
constexpr NameEntry kNames[] = {{StrategyKind::kLvXAttn, "lv_xattn"},
                                {StrategyKind::kRing, "ring"},
                                {StrategyKind::kStriped, "striped"},
                                {StrategyKind::kUlysses, "ulysses"},
                                {StrategyKind::kAllGather, "all_gather"},
                                {StrategyKind::kDistFlash, "distflash"}};
}  // namespace

std::string strategy_name(StrategyKind k) {
  for (const auto& e : kNames)
    if (e.kind == k) return e.name;
  return "unknown";
}

StrategyKind strategy_from_name(const std::string& name) {
  std::string valid;
  for (const auto& e : kNames) {
    if (name == e.name) return e.kind;
    valid += str(valid.empty() ? "" : ", ", e.name);
  }
  LVX_FAIL("unknown strategy '", name, "' (valid: ", valid, ")");
}

std::vector<StrategyKind> all_strategies() {
  std::vector<StrategyKind> out;
  for (const auto& e : kNames) out.push_back(e.kind);
  return out;
}

std::string StrategyChoice::name() const {
  return forward == backward ? strategy_name(forward)
                             : strategy_name(forward) + "+" + strategy_name(backward);
}

bool can_pair(StrategyKind f, StrategyKind b) {
  if (f == b) return true;
  auto fs = make_strategy(f), bs = make_strategy(b);
  // Same saved form and the same layouts (checked on a spec where layouts can differ).
  AttentionSpec probe;
  probe.sq = probe.skv = 5;
  return fs->saved_form() == SavedForm::kShards && bs->saved_form() == SavedForm::kShards &&
         fs->q_layout(probe, 2).kind == bs->q_layout(probe, 2).kind &&
         fs->kv_layout(probe, 2).kind == bs->kv_layout(probe, 2).kind;
}

StrategyChoice strategy_choice_from_name(const std::string& name) {
  const auto plus = name.find('+');
  if (plus == std::string::npos) return StrategyChoice(strategy_from_name(name));
  StrategyChoice c(strategy_from_name(name.substr(0, plus)), strategy_from_name(name.substr(plus + 1)));
  if (!can_pair(c.forward, c.backward)) {
    std::string pairs;
    for (StrategyKind f : all_strategies())
      for (StrategyKind b : all_strategies())
        if (f != b && can_pair(f, b))
          pairs += str(pairs.empty() ? "" : ", ", strategy_name(f), "+", strategy_name(b));
    LVX_FAIL("strategy '", name, "': the backward of ", strategy_name(c.backward),
             " cannot start from what the forward of ", strategy_name(c.forward),
             " saves (different saved tensors or token layouts); pairs that can: ", pairs);
  }
  return c;
}

void check_qkv(const std::string& where, const at::Tensor& q, const at::Tensor& k,
               const at::Tensor& v) {
  for (auto [name, t] : {std::pair{"q", &q}, std::pair{"k", &k}, std::pair{"v", &v}})
    LVX_CHECK(t->defined() && t->dim() == 4, where, ": tensor '", name,
              "' must have 4 dimensions [B, S, H, D], got ",
              t->defined() ? str(t->sizes()) : std::string("none"));
  LVX_CHECK(k.sizes() == v.sizes(), where, ": k ", k.sizes(), " and v ", v.sizes(),
            " must have the same shape");
  LVX_CHECK(q.size(0) == k.size(0), where, ": batch of q (", q.size(0), ") and k (", k.size(0),
            ") differ");
  LVX_CHECK(q.size(3) == k.size(3), where, ": head dim of q (", q.size(3), ") and k (", k.size(3),
            ") differ");
  LVX_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, where, ": k has ", k.size(2),
            " heads, which does not divide q's ", q.size(2), " heads");
  LVX_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), where,
            ": q, k, v must share a dtype (got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
            v.scalar_type(), ")");
  LVX_CHECK(at::isFloatingType(q.scalar_type()), where, ": q must be floating point, got ",
            q.scalar_type());
}

void check_mask_inputs(const std::string& where, const AttentionSpec& s, const MaskInputs& m) {
  if (s.mask == kernels::MaskKind::kMedia) {
    LVX_CHECK(m.q_media.defined() && m.kv_media.defined(), where,
              ": the media mask needs q_media and kv_media");
    LVX_CHECK(m.q_media.scalar_type() == at::kInt && m.kv_media.scalar_type() == at::kInt, where,
              ": q_media and kv_media must be int32");
    LVX_CHECK(m.q_media.sizes() == at::IntArrayRef({s.batch, s.sq}), where, ": q_media must be [",
              s.batch, ", ", s.sq, "], got ", m.q_media.sizes());
    LVX_CHECK(m.kv_media.sizes() == at::IntArrayRef({s.batch, s.skv}), where,
              ": kv_media must be [", s.batch, ", ", s.skv, "], got ", m.kv_media.sizes());
  }
  if (m.kv_valid.defined())
    LVX_CHECK(m.kv_valid.scalar_type() == at::kBool &&
                  m.kv_valid.sizes() == at::IntArrayRef({s.batch, s.skv}),
              where, ": kv_valid (padding mask) must be bool [", s.batch, ", ", s.skv, "], got ",
              m.kv_valid.scalar_type(), " ", m.kv_valid.sizes());
}

void check_local_shards(const std::string& where, const AttentionSpec& s, const Strategy& strategy,
                        int world, int rank, const at::Tensor& q, const at::Tensor& k) {
  for (auto [name, t, layout, total] :
       {std::tuple{"q", &q, strategy.q_layout(s, world), s.sq},
        std::tuple{"k", &k, strategy.kv_layout(s, world), s.skv}}) {
    const int64_t want = layout.local_size(rank);
    LVX_CHECK(t->size(1) == want, where, ": rank ", rank, "'s ", name, " shard holds ", t->size(1),
              " tokens, but ", strategy.name(), "'s ",
              layout.kind == LayoutKind::kStriped ? "striped" : "contiguous", " layout of ", total,
              " tokens over ", world, " ranks gives it ", want,
              " (shards cut for another number of ranks, or uneven shards: give the global "
              "lengths)");
  }
}

AttentionSpec with_topology(AttentionSpec s, const dist::ProcessGroup& pg) {
  if (s.node_size == 0) s.node_size = pg.info().local_world_size;
  return s;
}

at::Tensor has_keys(const at::Tensor& lse) { return lse > -std::numeric_limits<double>::infinity(); }

Volume PassSchedule::volume() const {
  Volume v;
  for (const Message& m : messages) {
    v.sent += m.sent;
    v.received += m.received;
  }
  return v;
}

std::string AttentionSpec::describe() const {
  const char* m = mask == kernels::MaskKind::kNone     ? "none"
                  : mask == kernels::MaskKind::kCausal ? "causal"
                  : media_rule == kernels::MediaRule::kImmediate
                      ? (unmatched_sees_all ? "media_immediate_unmatched_sees_all"
                                            : "media_immediate")
                      : (unmatched_sees_all ? "media_upto_unmatched_sees_all" : "media_upto");
  return str("B=", batch, " Sq=", sq, " Skv=", skv, " Hq=", hq, " Hkv=", hkv, " D=", head_dim,
             " mask=", m, " scale=", scale, " layouts=", static_cast<int>(q_layout), "/",
             static_cast<int>(kv_layout), "x", kv_unit, " node_size=", node_size);
}

Layout Strategy::q_layout(const AttentionSpec& s, int world) const {
  return Layout{s.q_layout, s.sq, world, 1};
}

Layout Strategy::kv_layout(const AttentionSpec& s, int world) const {
  return Layout{s.kv_layout, s.skv, world, s.kv_unit};
}

kernels::AttentionParams block_params(const AttentionSpec& s, const MaskInputs& in,
                                      const at::Tensor& q_pos, const at::Tensor& k_pos) {
  kernels::AttentionParams p;
  p.scale = s.scale > 0 ? s.scale : 1.0 / std::sqrt(static_cast<double>(s.head_dim));
  p.mask.kind = s.mask;
  p.mask.media_rule = s.media_rule;
  p.mask.unmatched_sees_all = s.unmatched_sees_all;
  if (s.mask == kernels::MaskKind::kCausal) {
    p.mask.q_pos = q_pos + s.causal_offset();
    p.mask.k_pos = k_pos;
  } else if (s.mask == kernels::MaskKind::kMedia) {
    LVX_CHECK(in.q_media.defined() && in.kv_media.defined(),
              "media mask needs q_media [B, Sq] and kv_media [B, Skv]");
    p.mask.q_media = in.q_media.index_select(1, q_pos.to(in.q_media.device())).contiguous();
    p.mask.kv_media = in.kv_media.index_select(1, k_pos.to(in.kv_media.device())).contiguous();
  }
  if (in.kv_valid.defined())
    p.mask.kv_valid = in.kv_valid.index_select(1, k_pos.to(in.kv_valid.device())).contiguous();
  return p;
}

at::Tensor backward_delta(const at::Tensor& dout, const at::Tensor& o, const at::Tensor& dlse) {
  at::Tensor delta = kernels::attention_delta(dout, o);
  if (!dlse.defined()) return delta;
  // Rows without keys have lse = −inf and no gradient path; keep their delta finite.
  return delta - at::nan_to_num(dlse.to(delta.scalar_type()), 0.0, 0.0, 0.0);
}

int64_t element_bytes(at::ScalarType t) { return static_cast<int64_t>(c10::elementSize(t)); }

std::unique_ptr<Strategy> make_lv_xattn();
std::unique_ptr<Strategy> make_ring();
std::unique_ptr<Strategy> make_striped();
std::unique_ptr<Strategy> make_ulysses();
std::unique_ptr<Strategy> make_all_gather();
std::unique_ptr<Strategy> make_distflash();

std::unique_ptr<Strategy> make_strategy(StrategyKind k) {
  switch (k) {
    case StrategyKind::kLvXAttn: return make_lv_xattn();
    case StrategyKind::kRing: return make_ring();
    case StrategyKind::kStriped: return make_striped();
    case StrategyKind::kUlysses: return make_ulysses();
    case StrategyKind::kAllGather: return make_all_gather();
    case StrategyKind::kDistFlash: return make_distflash();
  }
  LVX_FAIL("unknown strategy kind");
}

}  // namespace lvx::attention
