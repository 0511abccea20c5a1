// lvx's operators for PyTorch (`import lvx`): the strategies of src/attention as torch custom ops
// on torch.distributed process groups, plus the layout, counter and planner entry points the
// Python package wraps. Registered with TORCH_LIBRARY, so the Python side needs no binding code
// (torch.ops.load_library) and torch.compile sees opaque ops with the fake kernels and autograd
// formulas registered in python/lvx/_ops.py.
//
//   lvx::attention_forward(q, k, v, q_media?, kv_media?, kv_valid?, group, strategy, spec, scale)
//       -> (o, lse, extra[])
//   lvx::attention_backward(dout, dlse?, q, k, v, o, lse, extra[], q_media?, kv_media?, kv_valid?,
//       group, strategy, spec, scale) -> (dq, dk, dv)
//
// `group` is a torch.distributed group_name (c10d's registry, as functional collectives use);
// lvx runs its own messages on that group's engines (dist::ProcessGroup::adopt), counted per
// peer. `spec` = [B, Sq, Skv, Hq, Hkv, D, mask, media_rule, q_layout, kv_layout, kv_unit]
// (global lengths; enums as in kernels/attention.h and src/attention/layout.h). `extra` is what
// the forward strategy saves beyond the call's own q, k, v, o, lse (Strategy::saved_form):
// nothing for the ring strategies, the gathered K and V for all_gather, the head-sharded Q, K,
// V, O and lse for ulysses; the backward rebuilds the SavedState from them, so the Python API
// sends exactly the bytes of the C++ API.
#include <torch/library.h>

#include <cmath>
#include <map>
#include <mutex>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include "src/attention/dist_attention.h"
#include "src/common/error.h"
#include "src/planner/planner.h"
#include "src/planner/train_report.h"
#include "src/runtime/model_description.h"

namespace {

using namespace lvx;
using attention::AttentionSpec;
using attention::SavedForm;

// Every lvx::Error leaves as a c10::ValueError (a Python ValueError) with the message alone.
template <class F>
auto guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const lvx::Error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// One lvx group per torch.distributed group, made on first use and kept (its counters too).
std::mutex groups_mu;
std::map<std::string, std::shared_ptr<dist::ProcessGroup>>& groups() {
  static auto* g = new std::map<std::string, std::shared_ptr<dist::ProcessGroup>>();
  return *g;  // never destroyed at exit: release_groups() (Python's atexit) ends them in order
}

std::shared_ptr<dist::ProcessGroup> group_for(const std::string& name) {
  std::lock_guard<std::mutex> lock(groups_mu);
  auto& g = groups()[name];
  // "": no torch.distributed run (a single process): one rank, every message a local copy.
  if (!g)
    g = name.empty() ? std::make_shared<dist::ProcessGroup>(dist::RendezvousInfo{})
                     : dist::ProcessGroup::adopt(name);
  return g;
}

// An enum entry of the spec list, range-checked: an out-of-range value from Python would
// otherwise be cast to an enumerator that does not exist (a mask kind of 7 ran unmasked).
template <class E>
E enum_entry(int64_t value, const char* field, std::initializer_list<const char*> names) {
  const int64_t n = static_cast<int64_t>(names.size());
  if (value < 0 || value >= n) {
    std::string valid;
    int64_t i = 0;
    for (const char* name : names) valid += str(valid.empty() ? "" : ", ", i++, " (", name, ")");
    LVX_FAIL("lvx.attention: spec ", field, " = ", value, " is out of range; valid: ", valid);
  }
  return static_cast<E>(value);
}

AttentionSpec spec_from(const std::vector<int64_t>& v, double scale) {
  LVX_CHECK(v.size() == 11, "lvx.attention: spec has ", v.size(), " entries, expected 11");
  static const char* const kSizes[] = {"batch", "sq", "skv", "hq", "hkv", "head_dim"};
  for (int i = 0; i < 6; ++i) {
    const bool length = i == 1 || i == 2;  // global lengths may be 0, counts may not
    LVX_CHECK(v[i] >= (length ? 0 : 1), "lvx.attention: spec ", kSizes[i], " = ", v[i],
              ", expected ", length ? ">= 0" : ">= 1");
  }
  LVX_CHECK(v[10] >= 1, "lvx.attention: spec kv_unit = ", v[10], ", expected >= 1");
  LVX_CHECK(std::isfinite(scale), "lvx.attention: scale = ", scale,
            ", expected a finite number (0: 1/sqrt(head_dim))");
  AttentionSpec s;
  s.batch = v[0];
  s.sq = v[1];
  s.skv = v[2];
  s.hq = v[3];
  s.hkv = v[4];
  s.head_dim = v[5];
  s.mask = enum_entry<kernels::MaskKind>(v[6], "mask", {"none", "causal", "media"});
  s.media_rule =
      enum_entry<kernels::MediaRule>(v[7], "media_rule", {"media_immediate", "media_upto"});
  s.q_layout = enum_entry<attention::LayoutKind>(v[8], "q_layout", {"contiguous", "striped"});
  s.kv_layout = enum_entry<attention::LayoutKind>(v[9], "kv_layout", {"contiguous", "striped"});
  s.kv_unit = v[10];
  s.scale = scale;
  return s;
}

attention::MaskInputs mask_from(const std::optional<at::Tensor>& q_media,
                                const std::optional<at::Tensor>& kv_media,
                                const std::optional<at::Tensor>& kv_valid) {
  attention::MaskInputs m;
  if (q_media) m.q_media = *q_media;
  if (kv_media) m.kv_media = *kv_media;
  if (kv_valid) m.kv_valid = *kv_valid;
  return m;
}

// Custom ops may not return views of their inputs (or of each other): copy any that would.
at::Tensor fresh(const at::Tensor& t, std::initializer_list<const at::Tensor*> inputs) {
  for (const at::Tensor* in : inputs)
    if (in->defined() && t.defined() && t.is_alias_of(*in)) return t.clone();
  return t;
}

constexpr const char* kWhere = "lvx.attention";

std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& q_media, const std::optional<at::Tensor>& kv_media,
    const std::optional<at::Tensor>& kv_valid, const std::string& group,
    const std::string& strategy, std::vector<int64_t> spec_values, double scale) {
  return guarded([&] {
    attention::check_qkv(kWhere, q, k, v);
    const AttentionSpec s0 = spec_from(spec_values, scale);
    const attention::MaskInputs mask = mask_from(q_media, kv_media, kv_valid);
    attention::check_mask_inputs(kWhere, s0, mask);
    auto pg = group_for(group);
    const attention::PreparedCall call = attention::prepare_call(
        kWhere, *pg, attention::strategy_choice_from_name(strategy), s0, q, k);
    attention::SavedState saved;
    attention::LocalOutput out = call.forward->forward(*pg, call.spec, {q, k, v, mask}, &saved);
    std::vector<at::Tensor> extra;
    switch (call.forward->saved_form()) {
      case SavedForm::kShards:
        break;
      case SavedForm::kGatheredKV:
        extra = {saved.tensors.at(1), saved.tensors.at(2)};
        break;
      case SavedForm::kHeadShards:
        extra = saved.tensors;
        break;
    }
    at::Tensor o = fresh(out.o, {&q, &k, &v});
    for (auto& t : extra) t = fresh(t, {&q, &k, &v, &o, &out.lse});
    return std::make_tuple(o, out.lse, extra);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const std::optional<at::Tensor>& dlse, const at::Tensor& q,
    const at::Tensor& k, const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
    std::vector<at::Tensor> extra, const std::optional<at::Tensor>& q_media,
    const std::optional<at::Tensor>& kv_media, const std::optional<at::Tensor>& kv_valid,
    const std::string& group, const std::string& strategy, std::vector<int64_t> spec_values,
    double scale) {
  return guarded([&] {
    auto pg = group_for(group);
    const attention::PreparedCall call =
        attention::prepare_call(kWhere, *pg, attention::strategy_choice_from_name(strategy),
                                spec_from(spec_values, scale), q, k);
    attention::SavedState saved;
    switch (call.forward->saved_form()) {
      case SavedForm::kShards:
        saved.tensors = {q, k, v, o, lse};
        break;
      case SavedForm::kGatheredKV:
        LVX_CHECK(extra.size() == 2, kWhere, ": all_gather's backward needs the gathered K and V");
        saved.tensors = {q, extra[0], extra[1], o, lse};
        break;
      case SavedForm::kHeadShards:
        LVX_CHECK(extra.size() == 5, kWhere, ": ulysses' backward needs its head shards");
        saved.tensors = extra;
        break;
    }
    attention::LocalGrads g =
        call.backward->backward(*pg, call.spec, mask_from(q_media, kv_media, kv_valid), saved, dout,
                                dlse.value_or(at::Tensor()));
    return std::make_tuple(g.dq, g.dk, g.dv);
  });
}

// int64 [local_size]: the global token index of each of `rank`'s tokens under the layout the
// (forward) strategy uses for `role` ("q" or "kv").
at::Tensor shard_positions(const std::string& strategy, const std::string& role, int64_t total,
                           int64_t world, int64_t rank, int64_t unit) {
  return guarded([&] {
    LVX_CHECK(role == "q" || role == "kv", "lvx.shard: role must be 'q' or 'kv', got '", role, "'");
    LVX_CHECK(world >= 1 && rank >= 0 && rank < world, "lvx.shard: rank ", rank,
              " outside a group of ", world);
    LVX_CHECK(unit >= 1 && total % unit == 0, "lvx.shard: ", total,
              " tokens do not split into blocks of ", unit);
    auto st = attention::make_strategy(attention::strategy_choice_from_name(strategy).forward);
    AttentionSpec s;
    s.sq = s.skv = total;
    s.kv_unit = role == "kv" ? unit : 1;
    // The strategy decides: striped and distflash split single tokens whatever the unit.
    attention::Layout l = role == "q" ? st->q_layout(s, static_cast<int>(world))
                                      : st->kv_layout(s, static_cast<int>(world));
    return l.positions(static_cast<int>(rank));
  });
}

// int64 [2, world]: bytes this rank's lvx messages sent to / received from each peer of the
// group since the last reset; and the seconds spent waiting.
std::tuple<at::Tensor, double> counters(const std::string& group) {
  return guarded([&] {
    auto pg = group_for(group);
    // A copy under the group's lock: autograd's backward thread may be completing messages.
    const dist::ByteCounters c = pg->counters_snapshot();
    return std::make_tuple(at::stack({at::tensor(c.sent), at::tensor(c.received)}), c.wait_seconds);
  });
}

void reset_counters(const std::string& group) {
  guarded([&] { group_for(group)->reset_counters(); });
}

void release_groups() {
  std::lock_guard<std::mutex> lock(groups_mu);
  groups().clear();
}

// `lvx plan` as a function: (the table the CLI prints, the plan as JSON).
std::tuple<std::string, std::string> plan(const std::string& model, const std::string& cluster,
                                          int64_t frames, int64_t text, int64_t tokens_per_frame,
                                          int64_t nproc, const std::string& dtype, bool train,
                                          const std::string& layout,
                                          std::vector<std::string> strategies) {
  return guarded([&] {
    planner::ModelConfig m = runtime::planner_model(model);
    planner::ClusterConfig c = planner::load_cluster_config(cluster);
    planner::Workload w;
    w.frames = frames;
    w.text_tokens = text;
    w.tokens_per_frame = tokens_per_frame;
    w.ranks = static_cast<int>(nproc);
    w.dtype = dtype;
    w.train = train;
    w.layout = planner::prompt_layout_from_string(layout);
    for (const auto& s : strategies) w.strategies.push_back(attention::strategy_from_name(s));
    planner::Plan p = planner::plan(m, c, w, planner::CostOptions{});
    if (!train) return std::make_tuple(planner::format_table(p), planner::to_json(p).dump());
    // Training: the whole memory of a rank as `lvx plan --train` prices it by default (full
    // fine-tuning under freeze.policy vision, shard none, every rank one sequence group).
    planner::TrainMemoryOptions mo;
    mo.ranks = nproc > 0 ? nproc : c.nodes * c.gpus_per_node;
    mo.elem_bytes = planner::dtype_bytes(dtype.empty() ? m.dtype : dtype, "dtype");
    const planner::ParamCounts counts = runtime::count_parameters(model, m, "vision");
    nlohmann::json j = planner::to_json(p);
    const std::string report = planner::train_report(
        m, counts, p, frames, text, tokens_per_frame > 0 ? tokens_per_frame : m.visual_tokens_per_frame,
        mo, c, j);
    return std::make_tuple(runtime::describe_parameters(counts, "vision", m, 0) +
                               planner::format_table(p) + report,
                           j.dump());
  });
}

// [sent, received]: the bytes this rank's schedule of one pass says it moves (Strategy::schedule,
// what the C++ gate and the cost model use), for checking the counters from Python.
std::vector<int64_t> schedule_bytes(const std::string& group, const std::string& strategy,
                                    std::vector<int64_t> spec_values, at::ScalarType dtype,
                                    bool backward) {
  return guarded([&] {
    auto pg = group_for(group);
    const auto choice = attention::strategy_choice_from_name(strategy);
    const AttentionSpec s = attention::with_topology(spec_from(spec_values, 0), *pg);
    auto st = attention::make_strategy(backward ? choice.backward : choice.forward);
    const auto v = st->analytic_bytes(s, pg->world_size(), pg->rank(), dtype, backward);
    return std::vector<int64_t>{v.sent, v.received};
  });
}

std::string saved_form(const std::string& strategy) {
  return guarded([&] {
    switch (attention::make_strategy(attention::strategy_choice_from_name(strategy).forward)
                ->saved_form()) {
      case SavedForm::kGatheredKV:
        return std::string("gathered_kv");
      case SavedForm::kHeadShards:
        return std::string("head_shards");
      default:
        return std::string("shards");
    }
  });
}

}  // namespace

TORCH_LIBRARY(lvx, m) {
  m.def(
      "attention_forward(Tensor q, Tensor k, Tensor v, Tensor? q_media, Tensor? kv_media, "
      "Tensor? kv_valid, str group, str strategy, int[] spec, float scale) "
      "-> (Tensor, Tensor, Tensor[])");
  m.def(
      "attention_backward(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor o, "
      "Tensor lse, Tensor[] extra, Tensor? q_media, Tensor? kv_media, Tensor? kv_valid, str group, "
      "str strategy, int[] spec, float scale) -> (Tensor, Tensor, Tensor)");
  m.def(
      "shard_positions(str strategy, str role, int total, int world, int rank, int unit) -> Tensor",
      &shard_positions);
  m.def("counters(str group) -> (Tensor, float)", &counters);
  m.def("reset_counters(str group) -> ()", &reset_counters);
  m.def("release_groups() -> ()", &release_groups);
  m.def(
      "plan(str model, str cluster, int frames, int text, int tokens_per_frame, int nproc, "
      "str dtype, bool train, str layout, str[] strategies) -> (str, str)",
      &plan);
  m.def("saved_form(str strategy) -> str", &saved_form);
  m.def(
      "schedule_bytes(str group, str strategy, int[] spec, ScalarType dtype, bool backward) "
      "-> int[]",
      &schedule_bytes);
}

TORCH_LIBRARY_IMPL(lvx, CompositeExplicitAutograd, m) {
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_backward", &attention_backward);
}
