#include "src/planner/planner.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <limits>
#include <sstream>

#include "src/attention/media_mask.h"
#include "src/common/error.h"

namespace lvx::planner {

namespace {

using attention::strategy_name;

std::string seconds(double s) {
  std::ostringstream os;
  os << std::setprecision(3);
  if (s >= 1) {
    os << s << "s";
  } else if (s >= 1e-3) {
    os << s * 1e3 << "ms";
  } else {
    os << s * 1e6 << "us";
  }
  return os.str();
}

std::string bytes(double b) {
  std::ostringstream os;
  os << std::setprecision(3);
  if (b >= double(1LL << 30)) {
    os << b / double(1LL << 30) << "G";
  } else if (b >= double(1 << 20)) {
    os << b / double(1 << 20) << "M";
  } else {
    os << b / 1024 << "K";
  }
  return os.str();
}

std::string describe(const StrategyCost& c, bool train) {
  std::ostringstream os;
  os << strategy_name(c.strategy) << " is " << c.bound << "-bound (compute "
     << seconds(c.fwd_compute_s + c.bwd_compute_s) << ", communication "
     << seconds(c.fwd_comm_s + c.bwd_comm_s) << " if not overlapped, sends "
     << bytes(c.bytes_sent.forward + (train ? c.bytes_sent.backward : 0)) << " per rank)";
  return os.str();
}

struct PassChoice {
  StrategyKind forward, backward;
  double time_s, mem_bytes, saved_bytes;
  double bytes = 0;  // sent per rank, forward and backward
};

// Predicted times this close are one time: the cost model's own error (bench-plan's measured
// noise band and regret are a few percent) is larger than the difference.
constexpr double kTimeTie = 0.02;

// Whether `a` is the better choice than the best so far `b`: faster beyond the tie band; within
// it, the one that sends fewer bytes (its time survives slower links, contention and imperfect
// overlap: in LV-XAttn's headline configuration ring's forward ties lv_xattn's while sending 57x
// the bytes); then the pure pair over a mixed one.
bool better(const PassChoice& a, const PassChoice& b) {
  if (!std::isfinite(b.time_s)) return true;
  if (a.time_s < b.time_s * (1 - kTimeTie)) return true;
  if (a.time_s > b.time_s * (1 + kTimeTie)) return false;
  if (a.bytes != b.bytes) return a.bytes < b.bytes * 0.999;
  const bool a_pure = a.forward == a.backward, b_pure = b.forward == b.backward;
  if (a_pure != b_pure) return a_pure;
  return a.time_s < b.time_s;
}

// Whether `s` is among the candidates (none listed: all are).
bool is_candidate(const std::vector<StrategyKind>& strategies, StrategyKind s) {
  return strategies.empty() ||
         std::find(strategies.begin(), strategies.end(), s) != strategies.end();
}

// Every feasible (forward, backward) pair of a layer among the candidates.
template <typename Candidate>
std::vector<PassChoice> pass_choices(const LayerPlan& lp, bool split, const Candidate& candidate) {
  std::vector<PassChoice> out;
  for (StrategyKind f : attention::all_strategies()) {
    for (StrategyKind b : attention::all_strategies()) {
      if ((!split && f != b) || !attention::can_pair(f, b) || !candidate(f) || !candidate(b))
        continue;
      const StrategyCost &cf = lp.costs.at(f), &cb = lp.costs.at(b);
      if (!cf.feasible || !cb.feasible) continue;
      out.push_back({f, b, cf.fwd_s + cb.bwd_s, std::max(cf.mem_bytes, cb.mem_bytes),
                     std::max(cf.saved_bytes, cb.saved_bytes),
                     cf.bytes_sent.forward + cb.bytes_sent.backward});
    }
  }
  return out;
}

// A plan's names, workload, ranks (0: every GPU of the cluster, checked against it) and options.
Plan start_plan(const ModelConfig& m, const ClusterConfig& c, const Workload& w,
                const CostOptions& opt_in) {
  Plan p;
  p.model = m.name;
  p.cluster = c.name;
  p.workload = w;
  LVX_CHECK(w.ranks >= 0, "--nproc: expected >= 0 (0: every GPU of the cluster), got ", w.ranks);
  p.ranks = w.ranks > 0 ? w.ranks : c.world_size();
  LVX_CHECK(p.ranks <= c.world_size(), "--nproc: cluster '", c.name, "' has ", c.world_size(),
            " GPUs, got ", p.ranks);
  p.options = opt_in;
  p.options.train = w.train;
  return p;
}

// Plans each layer on its own, and the visual features the cross layers share (training with
// their K/V recomputed).
void plan_layers(const std::vector<LayerWorkload>& works, const ClusterConfig& c, const Workload& w,
                 Plan* p) {
  for (size_t i = 0; i < works.size(); ++i) {
    LayerPlan lp = plan_layer(static_cast<int>(i), works[i], c, p->ranks, p->options,
                              p->options.train && w.split_passes, w.strategies);
    if (lp.work.kind == LayerKind::kCross && w.train && p->options.recompute_cross_kv) {
      p->shared_visual_bytes = shard_bytes(lp.work, p->ranks, p->options).y;
    }
    p->layers.push_back(std::move(lp));
  }
}

// The text layout the runtime will use (models::resolve_layouts): striped when any layer runs
// striped. The cross layers' queries are that text, so they are priced again on it:
// lv_xattn's query blocks are then balanced under a media mask too.
void replan_cross_on_text_layout(const ClusterConfig& c, const Workload& w, Plan* p) {
  if (p->options.text_layout != attention::LayoutKind::kStriped) {
    bool striped = false;
    for (const LayerPlan& l : p->layers)
      striped =
          striped || l.forward == StrategyKind::kStriped || l.backward == StrategyKind::kStriped;
    if (striped) {
      p->options.text_layout = attention::LayoutKind::kStriped;
      for (LayerPlan& l : p->layers)
        if (l.work.kind == LayerKind::kCross)
          l = plan_layer(l.index, l.work, c, p->ranks, p->options,
                         p->options.train && w.split_passes, w.strategies);
    }
  }
}

// The plan's peak memory per rank: every layer's saved activations, the shared visual features
// and the largest working set.
double peak_bytes(const Plan& p) {
  double saved = 0, working = 0;
  for (const LayerPlan& l : p.layers) {
    const double sv =
        std::max(l.costs.at(l.forward).saved_bytes, l.costs.at(l.backward).saved_bytes);
    saved += sv;
    working = std::max(working, l.mem_bytes - sv);
  }
  return saved + p.shared_visual_bytes + working;
}

// A layer's other choice that frees saved memory (layer null: none does).
struct MemoryTrade {
  LayerPlan* layer;
  PassChoice choice;
};

// The layer choice that frees saved memory at the least time per byte.
MemoryTrade cheapest_trade(const Workload& w, Plan* p) {
  auto candidate = [&](StrategyKind s) { return is_candidate(w.strategies, s); };
  double best_ratio = std::numeric_limits<double>::infinity();
  LayerPlan* best_layer = nullptr;
  PassChoice best_choice{};
  for (LayerPlan& l : p->layers) {
    const double cur_saved =
        std::max(l.costs.at(l.forward).saved_bytes, l.costs.at(l.backward).saved_bytes);
    for (const PassChoice& pc : pass_choices(l, p->options.train && w.split_passes, candidate)) {
      const double freed = cur_saved - pc.saved_bytes;
      if (freed <= 0) continue;
      const double ratio = std::max(pc.time_s - l.time_s, 0.0) / freed;
      if (ratio < best_ratio) {
        best_ratio = ratio;
        best_layer = &l;
        best_choice = pc;
      }
    }
  }
  return {best_layer, best_choice};
}

// Switches layer l to best_choice, saying why in front of its explanation.
void apply_trade(LayerPlan& l, const PassChoice& best_choice) {
  const std::string before = l.choice_name();
  const double freed =
      std::max(l.costs.at(l.forward).saved_bytes, l.costs.at(l.backward).saved_bytes) -
      best_choice.saved_bytes;
  l.forward = best_choice.forward;
  l.backward = best_choice.backward;
  l.time_s = best_choice.time_s;
  l.mem_bytes = best_choice.mem_bytes;
  l.explanation = l.choice_name() + " " + seconds(l.time_s) + " instead of " + before +
                  ", to fit the whole plan in memory (frees " + bytes(freed) +
                  " of saved activations per rank); " + l.explanation;
}

// Whole-plan memory: every layer's saved activations live until its backward, plus the shared
// visual features and the largest working set. While that exceeds the budget, trade the layer
// choice that frees saved memory at the least time per byte (a greedy knapsack step).
void fit_in_memory(const ClusterConfig& c, const Workload& w, Plan* p) {
  const double budget = static_cast<double>(c.device_memory_bytes) - p->options.reserved_bytes;
  p->peak_mem_bytes = peak_bytes(*p);
  while (p->peak_mem_bytes > budget) {
    const MemoryTrade trade = cheapest_trade(w, p);
    if (trade.layer == nullptr) break;
    apply_trade(*trade.layer, trade.choice);
    p->peak_mem_bytes = peak_bytes(*p);
  }
  p->fits = p->peak_mem_bytes <= budget;
}

}  // namespace

const char* to_string(PromptLayout l) {
  return l == PromptLayout::kVideoQA ? "video_qa" : "interleaved";
}

PromptLayout prompt_layout_from_string(const std::string& s) {
  if (s == "video_qa") return PromptLayout::kVideoQA;
  if (s == "interleaved") return PromptLayout::kInterleaved;
  LVX_FAIL("--layout: expected video_qa|interleaved, got '", s, "'");
}

at::Tensor prompt_ids(const Workload& w) {
  if (w.prompt_marks.defined()) {
    LVX_CHECK(w.prompt_marks.sizes() == at::IntArrayRef({1, w.text_tokens}) &&
                  w.prompt_marks.sum().item<int64_t>() == w.frames,
              "workload: prompt_marks must be [1, ", w.text_tokens, "] with ", w.frames,
              " frame tokens");
    return w.prompt_marks.to(at::kLong);
  }
  std::vector<int64_t> ids(static_cast<size_t>(w.text_tokens), 0);  // on the host: no op per frame
  for (int64_t f = 0; f < w.frames; ++f) {
    const int64_t pos = w.layout == PromptLayout::kVideoQA ? f : f * w.text_tokens / w.frames;
    ids[static_cast<size_t>(pos)] = 1;
  }
  return at::tensor(ids, at::kLong).unsqueeze(0);
}

std::vector<LayerWorkload> layer_workloads(const ModelConfig& m, const Workload& w) {
  LVX_CHECK(w.frames > 0, "--frames: expected > 0, got ", w.frames);
  LVX_CHECK(w.text_tokens >= w.frames, "--text: expected >= --frames (", w.frames,
            ", one <image> token per frame), got ", w.text_tokens);
  // The prompt and its mask metadata are built token by token: bound them before allocating.
  LVX_CHECK(w.text_tokens <= kMaxPlanTextTokens, "--text: expected at most ", kMaxPlanTextTokens,
            " tokens, got ", w.text_tokens);
  LVX_CHECK(w.tokens_per_frame >= 0, "--tokens-per-frame: expected >= 0 (0: the model's), got ",
            w.tokens_per_frame);
  const int64_t tpf = w.tokens_per_frame > 0 ? w.tokens_per_frame : m.visual_tokens_per_frame;
  LVX_CHECK(w.frames <= kMaxPlanVisualTokens / tpf, "--frames: ", w.frames, " frames x ", tpf,
            " tokens per frame is more than the ", kMaxPlanVisualTokens,
            " visual tokens the planner plans for");
  const std::string dtype = w.dtype.empty() ? m.dtype : w.dtype;
  const int64_t e = dtype_bytes(dtype, "--dtype");
  const at::Tensor ids = prompt_ids(w);
  std::map<std::string, std::shared_ptr<PairCounter>> counters;  // one per mask and shape
  std::vector<LayerWorkload> out;
  for (const AttentionLayerConfig& l : m.layers) {
    LayerWorkload lw;
    lw.kind = l.kind;
    lw.sq = w.text_tokens;
    lw.skv = l.kind == LayerKind::kSelf ? w.text_tokens : w.frames * tpf;
    lw.kv_unit = l.kind == LayerKind::kSelf ? 1 : tpf;
    lw.heads = l.heads;
    lw.kv_heads = l.kv_heads;
    lw.head_dim = l.head_dim;
    lw.hidden_size = l.hidden_size;
    lw.visual_feature_dim = l.kind == LayerKind::kCross ? m.visual_feature_dim : 0;
    lw.mask = l.mask;
    auto& counter = counters[str(to_string(l.mask), lw.sq, "x", lw.skv)];
    if (!counter) {
      if (l.mask == MaskRule::kMediaUpTo || l.mask == MaskRule::kMediaImmediate) {
        // media_upto: every image before the token (an image from the token after its own on);
        // media_immediate: the most recent image, its own token included.
        const attention::MediaMaskRule rule =
            l.mask == MaskRule::kMediaUpTo
                ? attention::MediaMaskRule{attention::MediaSees::kUpToMostRecent, false}
                : attention::MediaMaskRule{attention::MediaSees::kMostRecent, true};
        const attention::MediaMask mm = attention::media_mask(rule, ids, 1, tpf, w.frames);
        counter = std::make_shared<PairCounter>(l.mask, lw.sq, lw.skv, mm.q_media, mm.kv_media);
      } else {
        counter = std::make_shared<PairCounter>(l.mask, lw.sq, lw.skv);
      }
    }
    lw.pairs = counter;
    lw.elem_bytes = e;
    lw.dtype = dtype;
    out.push_back(lw);
  }
  return out;
}

LayerPlan plan_layer(int index, const LayerWorkload& work, const ClusterConfig& c, int64_t ranks,
                     const CostOptions& opt, bool split_passes,
                     const std::vector<StrategyKind>& strategies) {
  auto candidate = [&](StrategyKind s) { return is_candidate(strategies, s); };
  LayerPlan lp;
  lp.index = index;
  lp.work = work;
  for (StrategyKind s : attention::all_strategies())
    lp.costs[s] = estimate(s, lp.work, c, ranks, opt);
  PassChoice chosen{StrategyKind::kLvXAttn, StrategyKind::kLvXAttn,
                    std::numeric_limits<double>::infinity(), 0, 0, 0};
  for (const PassChoice& pc : pass_choices(lp, split_passes, candidate))
    if (better(pc, chosen)) chosen = pc;
  const double best = chosen.time_s;
  lp.forward = chosen.forward;
  lp.backward = chosen.backward;
  lp.mem_bytes = chosen.mem_bytes;
  if (!std::isfinite(best)) {
    std::string why;
    for (const auto& [s, cost] : lp.costs) why += str("; ", strategy_name(s), ": ", cost.reason);
    LVX_FAIL("layer ", index, " (", to_string(lp.work.kind), "): no feasible strategy", why);
  }
  lp.time_s = best;
  double second = std::numeric_limits<double>::infinity();
  for (StrategyKind s : attention::all_strategies()) {
    const StrategyCost& cs = lp.costs[s];
    if (s == lp.forward || !cs.feasible || !candidate(s)) continue;
    if (cs.fwd_s + cs.bwd_s < second) {
      second = cs.fwd_s + cs.bwd_s;
      lp.runner_up = s;
      lp.has_runner_up = true;
    }
  }
  std::ostringstream ex;
  ex << lp.choice_name() << " " << seconds(best);
  if (lp.has_runner_up) {
    ex << " vs " << strategy_name(lp.runner_up) << " " << seconds(second) << " ("
       << std::setprecision(3) << second / best
       << "x): " << describe(lp.costs[lp.forward], opt.train) << "; "
       << describe(lp.costs[lp.runner_up], opt.train);
  } else {
    ex << ": the only feasible strategy";
  }
  for (StrategyKind s : attention::all_strategies()) {
    if (!lp.costs[s].feasible)
      ex << "; " << strategy_name(s) << " infeasible: " << lp.costs[s].reason;
  }
  lp.explanation = ex.str();
  return lp;
}

Plan plan(const ModelConfig& m, const ClusterConfig& c, const Workload& w,
          const CostOptions& opt_in) {
  Plan p = start_plan(m, c, w, opt_in);
  const std::vector<LayerWorkload> works = layer_workloads(m, w);
  plan_layers(works, c, w, &p);
  replan_cross_on_text_layout(c, w, &p);
  fit_in_memory(c, w, &p);
  for (const LayerPlan& l : p.layers) p.total_s += l.time_s;
  return p;
}

double uniform_time(const Plan& p, StrategyKind s, LayerKind kind) {
  double t = 0;
  for (const LayerPlan& l : p.layers) {
    if (l.work.kind != kind) continue;
    const StrategyCost& c = l.costs.at(s);
    if (!c.feasible) return std::numeric_limits<double>::infinity();
    t += c.fwd_s + c.bwd_s;
  }
  return t;
}

nlohmann::json to_json(const Plan& p) {
  using nlohmann::json;
  json layers = json::array();
  for (const LayerPlan& l : p.layers) {
    json pred = json::object();
    for (const auto& [s, c] : l.costs) {
      pred[strategy_name(s)] = {{"fwd_s", c.fwd_s},
                                {"bwd_s", c.bwd_s},
                                {"mem_bytes", c.mem_bytes},
                                {"feasible", c.feasible},
                                {"reason", c.reason},
                                {"bound", c.bound},
                                {"bytes_sent_fwd", c.bytes_sent.forward},
                                {"bytes_sent_bwd", c.bytes_sent.backward},
                                {"compute_s", c.fwd_compute_s + c.bwd_compute_s},
                                {"comm_s", c.fwd_comm_s + c.bwd_comm_s}};
    }
    layers.push_back({{"index", l.index},
                      {"kind", to_string(l.work.kind)},
                      {"sq", l.work.sq},
                      {"skv", l.work.skv},
                      {"heads", l.work.heads},
                      {"kv_heads", l.work.kv_heads},
                      {"head_dim", l.work.head_dim},
                      {"mask", to_string(l.work.mask)},
                      {"mask_density", l.work.density()},
                      {"choice", l.choice_name()},
                      {"choice_forward", strategy_name(l.forward)},
                      {"choice_backward", strategy_name(l.backward)},
                      {"runner_up", l.has_runner_up ? strategy_name(l.runner_up) : ""},
                      {"time_s", l.time_s},
                      {"mem_bytes", l.mem_bytes},
                      {"explanation", l.explanation},
                      {"predicted", pred}});
  }
  json uniform = json::object();
  for (StrategyKind s : attention::all_strategies()) {
    double t = uniform_time(p, s, LayerKind::kSelf) + uniform_time(p, s, LayerKind::kCross);
    uniform[strategy_name(s)] = std::isfinite(t) ? json(t) : json(nullptr);
  }
  double cross = 0, self = 0;
  for (const LayerPlan& l : p.layers) (l.work.kind == LayerKind::kCross ? cross : self) += l.time_s;
  json uniform_kind = json::object();
  for (StrategyKind s : attention::all_strategies()) {
    double ts = uniform_time(p, s, LayerKind::kSelf), tc = uniform_time(p, s, LayerKind::kCross);
    uniform_kind[strategy_name(s)] = {{"self_s", std::isfinite(ts) ? json(ts) : json(nullptr)},
                                      {"cross_s", std::isfinite(tc) ? json(tc) : json(nullptr)}};
  }
  json total = {{"time_s", p.total_s},
                {"uniform_strategy_by_kind", uniform_kind},
                {"self_s", self},
                {"cross_s", cross},
                {"peak_mem_bytes", p.peak_mem_bytes},
                {"shared_visual_bytes", p.shared_visual_bytes},
                {"fits", p.fits},
                {"uniform_strategy_time_s", uniform}};
  return {{"model", p.model},
          {"cluster", p.cluster},
          {"ranks", p.ranks},
          {"frames", p.workload.frames},
          {"text", p.workload.text_tokens},
          {"train", p.workload.train},
          {"layout", to_string(p.workload.layout)},
          {"expand_kv_heads", p.options.expand_kv_heads},
          {"skip_masked_tiles", p.options.skip_masked_tiles},
          {"topology_aware_ring", p.options.topology_aware_ring},
          {"text_layout",
           p.options.text_layout == attention::LayoutKind::kStriped ? "striped" : "contiguous"},
          {"layers", layers},
          {"total", total}};
}

std::string format_table(const Plan& p) {
  std::ostringstream os;
  os << "plan: model " << p.model << ", cluster " << p.cluster << ", " << p.ranks << " ranks, "
     << p.workload.frames << " frames, text " << p.workload.text_tokens << " ("
     << to_string(p.workload.layout) << " prompt, text "
     << (p.options.text_layout == attention::LayoutKind::kStriped ? "striped" : "contiguous")
     << "), " << (p.workload.train ? "training (fwd+bwd)" : "inference (fwd)") << "\n";
  os << std::left << std::setw(7) << "layers" << std::setw(6) << "kind" << std::setw(22)
     << "Sq/rank x Skv/rank";
  for (StrategyKind s : attention::all_strategies()) os << std::setw(19) << strategy_name(s);
  os << std::setw(16) << "choice"
     << "runner-up\n";
  // Consecutive layers with the same work and choice share a row ("2-9").
  auto same = [](const LayerPlan& a, const LayerPlan& b) {
    return a.work.kind == b.work.kind && a.work.sq == b.work.sq && a.work.skv == b.work.skv &&
           a.work.heads == b.work.heads && a.work.kv_heads == b.work.kv_heads &&
           a.work.head_dim == b.work.head_dim && a.work.mask == b.work.mask &&
           a.forward == b.forward && a.backward == b.backward;
  };
  std::vector<std::pair<size_t, size_t>> groups;
  for (size_t i = 0; i < p.layers.size(); ++i) {
    if (!groups.empty() && same(p.layers[groups.back().first], p.layers[i])) {
      groups.back().second = i;
    } else {
      groups.push_back({i, i});
    }
  }
  auto label = [](const std::pair<size_t, size_t>& g) {
    return g.first == g.second ? std::to_string(g.first)
                               : std::to_string(g.first) + "-" + std::to_string(g.second);
  };
  for (const auto& g : groups) {
    const LayerPlan& l = p.layers[g.first];
    std::ostringstream shape;
    shape << l.work.sq / p.ranks << "x" << l.work.skv / p.ranks << " h" << l.work.heads << "/"
          << l.work.kv_heads;
    os << std::setw(7) << label(g) << std::setw(6) << to_string(l.work.kind) << std::setw(22)
       << shape.str();
    for (StrategyKind s : attention::all_strategies()) {
      const StrategyCost& c = l.costs.at(s);
      std::string cell = c.feasible ? seconds(c.fwd_s + c.bwd_s) + "/" + bytes(c.mem_bytes)
                                    : std::string("infeasible");
      os << std::setw(19) << cell;
    }
    os << std::setw(16) << l.choice_name() << (l.has_runner_up ? strategy_name(l.runner_up) : "-")
       << "\n";
  }
  os << "\nwhy (time per layer, forward" << (p.workload.train ? "+backward" : "")
     << "; memory per rank):\n";
  for (const auto& g : groups) {
    os << "  layer " << label(g) << ": " << p.layers[g.first].explanation << "\n";
  }
  os << "\ntotal " << seconds(p.total_s);
  const double ring = uniform_time(p, StrategyKind::kRing, LayerKind::kSelf) +
                      uniform_time(p, StrategyKind::kRing, LayerKind::kCross);
  if (std::isfinite(ring))
    os << " (ring everywhere: " << seconds(ring) << ", " << std::setprecision(3) << ring / p.total_s
       << "x)";
  os << "; peak memory per rank " << bytes(p.peak_mem_bytes)
     << (p.fits ? "" : " (DOES NOT FIT the device memory)") << "\n";
  return os.str();
}

}  // namespace lvx::planner
