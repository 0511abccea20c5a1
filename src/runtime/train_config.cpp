#include "src/runtime/train_config.h"

#include <yaml-cpp/yaml.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/runtime/hub_cache.h"

namespace lvx::runtime {

namespace {

// The section's node, or an empty one when absent (yaml-cpp's lookup of a missing key yields an
// invalid node that throws on any use).
YAML::Node section_of(const YAML::Node& root, const std::string& name) {
  for (const auto& kv : root)
    if (kv.first.as<std::string>() == name) return kv.second;
  return YAML::Node();
}

// One mapping of the config: typed reads naming "file: section.field", and a final check that
// every field present was read (the rest are unknown).
class Section {
 public:
  Section(const YAML::Node& root, const std::string& file, const std::string& name)
      : node_(section_of(root, name)), file_(file), name_(name) {
    if (node_.IsDefined() && !node_.IsNull())
      LVX_CHECK(node_.IsMap(), file_, ": ", name_, ": expected a mapping of fields, got '",
                YAML::Dump(node_), "'");
  }
  bool has(const std::string& key) {
    used_.insert(key);
    return node_.IsMap() && node_[key] && !node_[key].IsNull();
  }
  std::string where(const std::string& key) const { return str(file_, ": ", name_, ".", key); }

  template <typename T>
  T get(const std::string& key, const char* what) {
    LVX_CHECK(has(key), where(key), ": missing (required)");
    const YAML::Node n = node_[key];
    LVX_CHECK(n.IsScalar(), where(key), ": expected ", what, ", got '", YAML::Dump(n), "'");
    try {
      return n.as<T>();
    } catch (const YAML::Exception&) {
      LVX_FAIL(where(key), ": expected ", what, ", got '", n.Scalar(), "'");
    }
  }
  std::string str_or(const std::string& key, const std::string& d) {
    return has(key) ? get<std::string>(key, "a string") : d;
  }
  int64_t int_or(const std::string& key, int64_t d, int64_t min) {
    const int64_t v = has(key) ? get<int64_t>(key, "an integer") : d;
    LVX_CHECK(v >= min, where(key), ": must be >= ", min, ", got ", v);
    return v;
  }
  double num_or(const std::string& key, double d, double min) {
    const double v = has(key) ? get<double>(key, "a number") : d;
    LVX_CHECK(std::isfinite(v) && v >= min, where(key), ": must be a finite number >= ", min,
              ", got ", v);
    return v;
  }
  bool bool_or(const std::string& key, bool d) {
    return has(key) ? get<bool>(key, "true or false") : d;
  }
  std::string choice_or(const std::string& key, const std::string& d,
                        const std::vector<std::string>& allowed) {
    const std::string v = str_or(key, d);
    std::string list;
    for (const auto& a : allowed) {
      if (a == v) return v;
      list += (list.empty() ? "" : ", ") + a;
    }
    LVX_FAIL(where(key), ": expected one of ", list, ", got '", v, "'");
  }
  YAML::Node raw(const std::string& key) {
    used_.insert(key);
    return node_.IsMap() ? node_[key] : YAML::Node();
  }
  void finish() const {
    if (!node_.IsMap()) return;
    for (const auto& kv : node_) {
      const std::string k = kv.first.as<std::string>();
      if (used_.count(k)) continue;
      std::string known;
      for (const auto& u : used_) known += (known.empty() ? "" : ", ") + u;
      LVX_FAIL(where(k), ": unknown field (known in '", name_, "': ", known, ")");
    }
  }

 private:
  YAML::Node node_;
  std::string file_, name_;
  std::set<std::string> used_;
};

const std::vector<std::string> kSections = {"model",  "data",       "optimizer", "schedule",
                                            "freeze", "checkpoint", "parallel",  "logging",
                                            "lora",   "eval"};

// "section.field=value" sets root[section][field] to the value parsed as YAML (so numbers,
// booleans and lists keep their types); "section={field: value, ...}" (a flow-style map) sets
// each of its fields the same way.
void apply_override(YAML::Node& root, const std::string& o) {
  const size_t eq = o.find('=');
  LVX_CHECK(eq != std::string::npos && eq > 0, "command line: override '", o,
            "' must look like section.field=value or section={field: value}");
  const std::string key = o.substr(0, eq), value = o.substr(eq + 1);
  std::vector<std::string> parts;
  std::stringstream ss(key);
  for (std::string p; std::getline(ss, p, '.');) parts.push_back(p);
  LVX_CHECK((parts.size() == 2 && !parts[0].empty() && !parts[1].empty()) ||
                (parts.size() == 1 && !parts[0].empty()),
            "command line: override '", o,
            "': the key must be section.field (e.g. optimizer.lr=1e-3) or a section "
            "(lora={r: 8, alpha: 16})");
  bool known = false;
  for (const auto& s : kSections) known = known || s == parts[0];
  LVX_CHECK(known, "command line: override '", o, "': unknown section '", parts[0], "'");
  YAML::Node v;
  try {
    v = YAML::Load(value);
  } catch (const YAML::Exception& e) {
    LVX_FAIL("command line: override '", o, "': the value is not valid YAML: ", e.what());
  }
  if (!root[parts[0]] || !root[parts[0]].IsMap()) root[parts[0]] = YAML::Node(YAML::NodeType::Map);
  YAML::Node section = root[parts[0]];
  if (parts.size() == 2) {
    section[parts[1]] = v;
    return;
  }
  LVX_CHECK(v.IsMap(), "command line: override '", o, "': a section takes a map, e.g. ", parts[0],
            "={field: value}");
  for (const auto& kv : v) section[kv.first.as<std::string>()] = kv.second;
}

}  // namespace

namespace {

TrainConfig from_root(const YAML::Node& root, const std::string& file);

}  // namespace

TrainConfig load_train_config(const std::string& path, const std::vector<std::string>& overrides) {
  uint64_t size = 0;
  try {
    size = check_regular_file(path, "run config");
  } catch (const Error& e) {
    LVX_FAIL(e.what(), " (expected the run's YAML config)");
  }
  LVX_CHECK(size <= kMaxConfigBytes, path, ": ", size, " bytes, more than a run config may have (",
            kMaxConfigBytes, ")");
  YAML::Node root;
  try {
    root = YAML::Load(read_file(path, "run config", kMaxConfigBytes));
  } catch (const YAML::Exception& e) {
    LVX_FAIL(path, ": not valid YAML: ", e.what());
  }
  if (!root || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  LVX_CHECK(root.IsMap(), path, ": the top level must be a mapping of sections");
  for (const auto& o : overrides) apply_override(root, o);
  return from_root(root, overrides.empty() ? path : path + " (with command-line overrides)");
}

TrainConfig train_config_from_yaml(const std::string& text, const std::string& where) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    LVX_FAIL(where, ": not valid YAML: ", e.what());
  }
  LVX_CHECK(root.IsMap(), where, ": expected a mapping of sections");
  return from_root(root, where);
}

namespace {

// The shortest text that reads back as the same double, as people write numbers: 0.9 (not the
// emitter's 0.90000000000000002), 30 (not %g's 3e+01), 1e-05.
std::string shortest(double v) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), v);
  return std::string(buf, r.ptr);
}

// A scalar as written, a number as shortest() writes it.
std::string shortest(const YAML::Node& v) {
  if (!v.IsScalar()) return YAML::Dump(v);
  const std::string s = v.Scalar();
  char* end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size()) return s;
  return shortest(d);
}

}  // namespace

std::vector<std::string> config_changes(const TrainConfig& before, const TrainConfig& now) {
  // Both through to_yaml, so that equal values print alike (numbers included).
  const YAML::Node a = YAML::Load(to_yaml(before)), b = YAML::Load(to_yaml(now));
  std::vector<std::string> changes;
  for (const char* section : {"data", "optimizer", "schedule", "freeze", "lora"}) {
    std::set<std::string> keys;
    for (const auto& kv : a[section]) keys.insert(kv.first.as<std::string>());
    for (const auto& kv : b[section]) keys.insert(kv.first.as<std::string>());
    for (const auto& k : keys) {
      // How samples are prepared changes no result: a resume may change it freely.
      if (std::string(section) == "data" && (k == "prefetch" || k == "workers")) continue;
      auto text = [&](const YAML::Node& root) {
        const YAML::Node v = root[section][k];
        if (!v) return std::string("(unset)");
        if (v.IsSequence()) {
          std::string list;
          for (const auto& e : v) list += (list.empty() ? "" : ", ") + shortest(e);
          return "[" + list + "]";
        }
        return shortest(v);
      };
      const std::string x = text(a), y = text(b);
      if (x != y) changes.push_back(str(section, ".", k, ": ", x, " -> ", y));
    }
  }
  return changes;
}

namespace {

void read_model(const YAML::Node& root, const std::string& file, TrainConfig& c) {
  Section s(root, file, "model");
  c.model.path = s.get<std::string>("path", "a checkpoint directory");
  // A Hugging Face name (org/name[@revision]) that is no folder here: its cached snapshot, as
  // --model takes it elsewhere (the error names where lvx looked and the download command).
  std::error_code ec;
  if (!std::filesystem::exists(c.model.path, ec) && is_hub_name(c.model.path))
    c.model.path = hub_snapshot(c.model.path);
  c.model.dtype = s.str_or("dtype", c.model.dtype);
  // Training keeps fp32 masters and has no loss scaling: fp16's range would overflow.
  LVX_CHECK(dtype_of(c.model.dtype, s.where("dtype")) != at::kHalf, s.where("dtype"),
            ": fp16 is not supported for training (no loss scaling); use bf16 or fp32");
  s.finish();
}

void read_data(const YAML::Node& root, const std::string& file, TrainConfig& c) {
  Section s(root, file, "data");
  c.data.train = s.get<std::string>("train", "a JSONL file");
  // Bounded before anything is allocated from them (frames are decoded into one batch).
  if (s.has("num_frames")) {
    c.data.num_frames = s.int_or("num_frames", 1, 1);
    LVX_CHECK(*c.data.num_frames <= kMaxFrames, s.where("num_frames"), ": at most ", kMaxFrames,
              " frames per sample, got ", *c.data.num_frames);
  }
  if (s.has("fps")) {
    c.data.fps = s.num_or("fps", 1, 1e-9);
    LVX_CHECK(*c.data.fps <= kMaxFps, s.where("fps"), ": at most ", kMaxFps,
              " frames per second, got ", *c.data.fps);
  }
  LVX_CHECK(c.data.num_frames.has_value() != c.data.fps.has_value(), s.where("num_frames"),
            ": give exactly one of data.num_frames and data.fps");
  c.data.shuffle = s.bool_or("shuffle", c.data.shuffle);
  c.data.seed = s.int_or("seed", c.data.seed, 0);
  c.data.prefetch = s.int_or("prefetch", c.data.prefetch, 0);
  LVX_CHECK(c.data.prefetch <= 64, s.where("prefetch"), ": at most 64 samples ahead, got ",
            c.data.prefetch);
  c.data.workers = s.int_or("workers", c.data.workers, 1);
  LVX_CHECK(c.data.workers <= 16, s.where("workers"), ": at most 16 workers, got ", c.data.workers);
  LVX_CHECK(c.data.seed <= kMaxSeed, s.where("seed"), ": at most ", kMaxSeed, ", got ",
            c.data.seed);
  s.finish();
}

void read_optimizer(const YAML::Node& root, const std::string& file, TrainConfig& c) {
  Section s(root, file, "optimizer");
  auto& o = c.optimizer;
  o.lr = s.num_or("lr", o.lr, 0);
  if (s.has("betas")) {
    const YAML::Node b = s.raw("betas");
    LVX_CHECK(b.IsSequence() && b.size() == 2, s.where("betas"),
              ": expected a list of two numbers, got '", YAML::Dump(b), "'");
    for (size_t i = 0; i < 2; ++i) {
      try {
        o.betas[i] = b[i].as<double>();
      } catch (const YAML::Exception&) {
        LVX_FAIL(s.where("betas"), ": expected a list of two numbers, got '", YAML::Dump(b), "'");
      }
      LVX_CHECK(o.betas[i] >= 0 && o.betas[i] < 1, s.where("betas"), ": each must be in [0, 1), ",
                "got ", o.betas[i]);
    }
  }
  o.eps = s.num_or("eps", o.eps, 0);
  o.weight_decay = s.num_or("weight_decay", o.weight_decay, 0);
  o.grad_clip = s.num_or("grad_clip", o.grad_clip, 0);
  o.grad_accum = s.int_or("grad_accum", o.grad_accum, 1);
  // One optimizer step takes grad_accum samples per data-parallel group: a count no run can
  // reach (2^62 hung a run in its first step's sampler) is refused.
  LVX_CHECK(o.grad_accum <= kMaxGradAccum, s.where("grad_accum"), ": must be at most ",
            kMaxGradAccum, " samples per step, got ", o.grad_accum);
  s.finish();
}

void read_schedule(const YAML::Node& root, const std::string& file, TrainConfig& c) {
  Section s(root, file, "schedule");
  c.schedule.steps = s.int_or("steps", 0, 1);
  LVX_CHECK(s.has("steps"), s.where("steps"), ": missing (required)");
  c.schedule.warmup_steps = s.int_or("warmup_steps", 0, 0);
  c.schedule.min_lr = s.num_or("min_lr", 0, 0);
  LVX_CHECK(c.schedule.min_lr <= c.optimizer.lr, s.where("min_lr"), ": ", c.schedule.min_lr,
            " exceeds optimizer.lr ", c.optimizer.lr);
  s.finish();
}

void read_freeze(const YAML::Node& root, const std::string& file, TrainConfig& c) {
  Section s(root, file, "freeze");
  c.freeze.policy = s.choice_or("policy", c.freeze.policy, {"vision", "cross_only", "none"});
  s.finish();
}

void read_checkpoint(const YAML::Node& root, const std::string& file, TrainConfig& c) {
  Section s(root, file, "checkpoint");
  c.checkpoint.dir = s.get<std::string>("dir", "a directory");
  c.checkpoint.every = s.int_or("every", 0, 0);
  c.checkpoint.keep = s.int_or("keep", 2, 1);
  s.finish();
}

void read_parallel(const YAML::Node& root, const std::string& file, TrainConfig& c) {
  Section s(root, file, "parallel");
  auto& p = c.parallel;
  p.nproc = s.int_or("nproc", 1, 1);
  LVX_CHECK(p.nproc <= kMaxRanks, s.where("nproc"), ": at most ", kMaxRanks, " local ranks, got ",
            p.nproc);
  p.strategies = s.str_or("strategies", p.strategies);
  p.cluster = s.str_or("cluster", "");
  p.recompute = s.bool_or("recompute", false);
  p.remat = s.bool_or("remat", false);
  p.shard = s.choice_or("shard", p.shard, {"none", "optimizer", "gradients", "parameters"});
  p.sp_size = s.int_or("sp_size", 0, 0);
  LVX_CHECK(p.sp_size <= kMaxRanks, s.where("sp_size"), ": at most ", kMaxRanks, ", got ",
            p.sp_size);
  s.finish();
}

void read_logging(const YAML::Node& root, const std::string& file, TrainConfig& c) {
  Section s(root, file, "logging");
  c.logging.metrics = s.str_or("metrics", c.checkpoint.dir + "/metrics.jsonl");
  c.logging.every = s.int_or("every", 1, 1);
  c.logging.tensorboard = s.str_or("tensorboard", "");
  s.finish();
}

void read_lora(const YAML::Node& root, const std::string& file, TrainConfig& c) {
  bool lora = false;  // a `lora:` section, even empty, turns LoRA on (models/lora.h)
  for (const auto& kv : root) lora = lora || kv.first.as<std::string>() == "lora";
  if (lora) {
    Section s(root, file, "lora");
    auto& l = c.lora;
    l.r = s.int_or("r", 8, 0);
    LVX_CHECK(l.r <= 65536, s.where("r"), ": at most 65536, got ", l.r);
    l.alpha = s.num_or("alpha", l.alpha, 1e-12);
    l.dropout = s.num_or("dropout", l.dropout, 0);
    LVX_CHECK(l.dropout == 0, s.where("dropout"), ": ", l.dropout,
              " is not supported: lvx applies ",
              "LoRA as a weight transform (W + (alpha/r)·B·A), where dropout on the layer's input ",
              "has no place; use 0 (an adapter trained with dropout still loads for inference)");
    if (s.has("target_modules")) {
      const YAML::Node t = s.raw("target_modules");
      l.target_modules.clear();
      try {
        if (t.IsScalar()) {
          l.target_modules.push_back(t.as<std::string>());
        } else {
          LVX_CHECK(t.IsSequence() && t.size() > 0, s.where("target_modules"),
                    ": expected a module name, a list of them, or all-linear, got '", YAML::Dump(t),
                    "'");
          for (const auto& e : t) l.target_modules.push_back(e.as<std::string>());
        }
      } catch (const YAML::Exception&) {
        LVX_FAIL(s.where("target_modules"), ": expected module names, got '", YAML::Dump(t), "'");
      }
      for (const auto& m : l.target_modules)
        LVX_CHECK(!m.empty(), s.where("target_modules"), ": an empty module name");
    }
    s.finish();
  }
}
void read_eval(const YAML::Node& root, const std::string& file, TrainConfig& c) {
  if (!root["eval"]) return;
  Section s(root, file, "eval");
  auto& e = c.eval;
  e.data = s.get<std::string>("data", "a JSONL file of held-out rows");
  e.every = s.int_or("every", 0, 0);
  e.max_rows = s.int_or("max_rows", 0, 0);
  e.accuracy = s.bool_or("accuracy", e.accuracy);
  e.max_new_tokens = s.int_or("max_new_tokens", e.max_new_tokens, 1);
  LVX_CHECK(e.max_new_tokens <= kMaxEvalTokens, s.where("max_new_tokens"), ": at most ",
            kMaxEvalTokens, ", got ", e.max_new_tokens);
  e.best_metric = s.choice_or("best_metric", "", {"", "eval_loss", "eval_accuracy"});
  LVX_CHECK(e.best_metric != "eval_accuracy" || e.accuracy, s.where("best_metric"),
            ": eval_accuracy needs eval.accuracy: true");
  // Generating needs every layer whole for each new token; stage 3 holds layers only while its
  // forward or backward passes them.
  LVX_CHECK(!e.accuracy || c.parallel.shard != "parameters", s.where("accuracy"),
            ": answering questions during training is not supported with parallel.shard ",
            "parameters (generation would gather every layer for every new token); set ",
            "eval.accuracy: false (the held-out loss is evaluated layer by layer) and score the ",
            "saved checkpoints with lvx qa");
  s.finish();
}

TrainConfig from_root(const YAML::Node& root, const std::string& file) {
  for (const auto& kv : root) {
    const std::string k = kv.first.as<std::string>();
    bool known = false;
    for (const auto& s : kSections) known = known || s == k;
    LVX_CHECK(known, file, ": ", k, ": unknown section (known: model, data, optimizer, schedule, ",
              "freeze, checkpoint, parallel, logging, lora, eval)");
  }
  TrainConfig c;
  read_model(root, file, c);
  read_data(root, file, c);
  read_optimizer(root, file, c);
  read_schedule(root, file, c);
  read_freeze(root, file, c);
  read_checkpoint(root, file, c);
  read_parallel(root, file, c);
  read_logging(root, file, c);
  read_lora(root, file, c);
  read_eval(root, file, c);
  return c;
}

}  // namespace

std::string to_yaml(const TrainConfig& c) {
  YAML::Emitter e;
  e << YAML::BeginMap;
  e << YAML::Key << "model" << YAML::Value << YAML::BeginMap << YAML::Key << "path" << YAML::Value
    << c.model.path << YAML::Key << "dtype" << YAML::Value << c.model.dtype << YAML::EndMap;
  e << YAML::Key << "data" << YAML::Value << YAML::BeginMap << YAML::Key << "train" << YAML::Value
    << c.data.train;
  if (c.data.num_frames) e << YAML::Key << "num_frames" << YAML::Value << *c.data.num_frames;
  if (c.data.fps) e << YAML::Key << "fps" << YAML::Value << shortest(*c.data.fps);
  e << YAML::Key << "shuffle" << YAML::Value << c.data.shuffle << YAML::Key << "seed" << YAML::Value
    << c.data.seed << YAML::Key << "prefetch" << YAML::Value << c.data.prefetch << YAML::Key
    << "workers" << YAML::Value << c.data.workers << YAML::EndMap;
  const auto& o = c.optimizer;
  e << YAML::Key << "optimizer" << YAML::Value << YAML::BeginMap << YAML::Key << "lr" << YAML::Value
    << shortest(o.lr) << YAML::Key << "betas" << YAML::Value << YAML::Flow << YAML::BeginSeq
    << shortest(o.betas[0]) << shortest(o.betas[1]) << YAML::EndSeq << YAML::Key << "eps"
    << YAML::Value << shortest(o.eps) << YAML::Key << "weight_decay" << YAML::Value
    << shortest(o.weight_decay) << YAML::Key << "grad_clip" << YAML::Value << shortest(o.grad_clip)
    << YAML::Key << "grad_accum" << YAML::Value << o.grad_accum << YAML::EndMap;
  e << YAML::Key << "schedule" << YAML::Value << YAML::BeginMap << YAML::Key << "steps"
    << YAML::Value << c.schedule.steps << YAML::Key << "warmup_steps" << YAML::Value
    << c.schedule.warmup_steps << YAML::Key << "min_lr" << YAML::Value
    << shortest(c.schedule.min_lr) << YAML::EndMap;
  e << YAML::Key << "freeze" << YAML::Value << YAML::BeginMap << YAML::Key << "policy"
    << YAML::Value << c.freeze.policy << YAML::EndMap;
  e << YAML::Key << "checkpoint" << YAML::Value << YAML::BeginMap << YAML::Key << "dir"
    << YAML::Value << c.checkpoint.dir << YAML::Key << "every" << YAML::Value << c.checkpoint.every
    << YAML::Key << "keep" << YAML::Value << c.checkpoint.keep << YAML::EndMap;
  const auto& p = c.parallel;
  e << YAML::Key << "parallel" << YAML::Value << YAML::BeginMap << YAML::Key << "nproc"
    << YAML::Value << p.nproc << YAML::Key << "strategies" << YAML::Value << p.strategies
    << YAML::Key << "cluster" << YAML::Value << p.cluster << YAML::Key << "recompute" << YAML::Value
    << p.recompute << YAML::Key << "remat" << YAML::Value << p.remat << YAML::Key << "shard"
    << YAML::Value << p.shard << YAML::Key << "sp_size" << YAML::Value << p.sp_size << YAML::EndMap;
  e << YAML::Key << "logging" << YAML::Value << YAML::BeginMap << YAML::Key << "metrics"
    << YAML::Value << c.logging.metrics << YAML::Key << "every" << YAML::Value << c.logging.every;
  if (!c.logging.tensorboard.empty())
    e << YAML::Key << "tensorboard" << YAML::Value << c.logging.tensorboard;
  e << YAML::EndMap;
  if (!c.eval.data.empty()) {
    const auto& v = c.eval;
    e << YAML::Key << "eval" << YAML::Value << YAML::BeginMap << YAML::Key << "data" << YAML::Value
      << v.data << YAML::Key << "every" << YAML::Value << v.every << YAML::Key << "max_rows"
      << YAML::Value << v.max_rows << YAML::Key << "accuracy" << YAML::Value << v.accuracy
      << YAML::Key << "max_new_tokens" << YAML::Value << v.max_new_tokens << YAML::Key
      << "best_metric" << YAML::Value << v.best_metric << YAML::EndMap;
  }
  if (c.lora.r > 0) {  // only when on: full fine-tuning's recorded configs stay as they were
    e << YAML::Key << "lora" << YAML::Value << YAML::BeginMap << YAML::Key << "r" << YAML::Value
      << c.lora.r << YAML::Key << "alpha" << YAML::Value << shortest(c.lora.alpha) << YAML::Key
      << "dropout" << YAML::Value << shortest(c.lora.dropout) << YAML::Key << "target_modules"
      << YAML::Value << YAML::Flow << c.lora.target_modules << YAML::EndMap;
  }
  e << YAML::EndMap;
  return std::string(e.c_str()) + "\n";
}

}  // namespace lvx::runtime
