#include "models/lora.h"

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <shared_mutex>
#include <unordered_map>

#include "kernels/linear.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/safetensors.h"

namespace lvx::models {

namespace fs = std::filesystem;

namespace {

const std::string kPrefix = "base_model.model.";
const std::string kWeight = ".weight";

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

std::string module_of(const std::string& weight) {
  return weight.substr(0, weight.size() - kWeight.size());
}

std::string last_component(const std::string& module) {
  const size_t dot = module.rfind('.');
  return dot == std::string::npos ? module : module.substr(dot + 1);
}

// Embedding tables (PEFT would give them its Embedding LoRA, another key layout) and output
// heads (PEFT's all-linear leaves the output layer out), by the names the families' checkpoints
// give them.
bool is_embedding(const std::string& module) {
  static const std::set<std::string> names{
      "embed_tokens",    "embed_in",       "wte", "wpe", "word_embeddings", "position_embedding",
      "patch_embedding", "token_embedding"};
  return names.count(last_component(module)) > 0;
}
bool is_output_head(const std::string& module) {
  const std::string c = last_component(module);
  return c == "lm_head" || c == "embed_out";
}

// PEFT's rule for a list of target modules (peft/tuners/tuners_utils.py
// check_target_module_exists): the module path equals an entry or ends with "." + entry.
bool peft_matches(const std::string& module, const std::string& target) {
  return module == target || ends_with(module, "." + target);
}

// Every linear weight of the model: 2-D "<module>.weight" tensors that are no embedding.
std::vector<std::string> linear_weights(Model& model) {
  std::vector<std::string> out;
  for (const auto& [name, t] : model.parameters())
    if (ends_with(name, kWeight) && t.dim() == 2 && !is_embedding(module_of(name)) &&
        name.find(".lora_") == std::string::npos)
      out.push_back(name);
  return out;
}

// Where an adapter of weight `w` lives: w's device, or, for a weight not read yet (meta: stage 3
// reads each rank's piece later), the device of the model's other weights.
at::Device placement(const StateDict& weights, const at::Tensor& w) {
  if (!w.is_meta()) return w.device();
  for (const auto& [name, t] : weights)
    if (!t.is_meta()) return t.device();
  return at::kCPU;
}

std::string regex_escape(const std::string& s) {
  static const std::string special = R"(\^$.|?*+()[]{})";
  std::string out;
  for (char c : s) {
    if (special.find(c) != std::string::npos) out += '\\';
    out += c;
  }
  return out;
}

// A module path with its first all-digit component (the layer index) generalised to \d+; later
// ones (positions in a Sequential: ff.1 is a Linear, ff.0 a LayerNorm) stay as they are.
std::string path_pattern(const std::string& module) {
  std::string out, part;
  bool generalised = false;
  auto flush = [&] {
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(),
                                                     [](char c) { return c >= '0' && c <= '9'; });
    out += digits && !generalised ? std::string(R"(\d+)") : regex_escape(part);
    generalised = generalised || digits;
    part.clear();
  };
  for (char c : module) {
    if (c == '.') {
      flush();
      out += R"(\.)";
    } else {
      part += c;
    }
  }
  flush();
  return out;
}

std::string join_alternatives(const std::set<std::string>& alts) {
  std::string out = "(?:";
  bool first = true;
  for (const auto& a : alts) {
    out += (first ? "" : "|") + a;
    first = false;
  }
  return out + ")";
}

double json_number(const nlohmann::json& c, const std::string& field, const std::string& where,
                   double fallback) {
  if (!c.contains(field) || c[field].is_null()) return fallback;
  LVX_CHECK(c[field].is_number(), where, ": field '", field, "' must be a number, got ",
            c[field].dump());
  return c[field].get<double>();
}

// A field that must be absent, null, false, empty or `ok` (a feature lvx does not apply).
void refuse_feature(const nlohmann::json& c, const std::string& field, const std::string& where,
                    const std::string& what) {
  if (!c.contains(field)) return;
  const nlohmann::json& v = c[field];
  const bool off = v.is_null() || (v.is_boolean() && !v.get<bool>()) ||
                   ((v.is_object() || v.is_array()) && v.empty());
  LVX_CHECK(off, where, ": field '", field, "' is ", v.dump(), ": ", what,
            " is not supported by lvx (only plain LoRA on linear weights)");
}

// adapter_config.json is a PEFT LoRA config with no feature lvx does not apply.
void check_adapter_config(const nlohmann::json& c, const std::string& cfg_path) {
  LVX_CHECK(c.is_object(), cfg_path, ": expected a JSON object");
  LVX_CHECK(c.value("peft_type", std::string()) == "LORA", cfg_path, ": field 'peft_type' is ",
            c.contains("peft_type") ? c["peft_type"].dump() : "missing", ", expected \"LORA\"");
  refuse_feature(c, "use_dora", cfg_path, "DoRA");
  refuse_feature(c, "fan_in_fan_out", cfg_path, "fan_in_fan_out (Conv1D weights)");
  refuse_feature(c, "alpha_pattern", cfg_path, "a per-module alpha");
  refuse_feature(c, "modules_to_save", cfg_path, "modules_to_save (fully trained modules)");
  refuse_feature(c, "layer_replication", cfg_path, "layer_replication");
  refuse_feature(c, "lora_bias", cfg_path, "a LoRA bias");
  refuse_feature(c, "trainable_token_indices", cfg_path, "trainable tokens");
  refuse_feature(c, "target_parameters", cfg_path, "LoRA on parameters");
  refuse_feature(c, "use_qalora", cfg_path, "QALoRA");
  LVX_CHECK(!c.contains("bias") || c["bias"] == "none", cfg_path, ": field 'bias' is ",
            c.contains("bias") ? c["bias"].dump() : "", ": only \"none\" is supported");
}

// An adapter with no layers yet: its config (alpha, dropout, r, target modules) and base model.
LoraAdapter adapter_from_config(const nlohmann::json& c, const std::string& cfg_path) {
  LoraAdapter ad;
  ad.config.alpha = json_number(c, "lora_alpha", cfg_path, 8);
  ad.config.dropout = json_number(c, "lora_dropout", cfg_path, 0);
  ad.config.r = static_cast<int64_t>(json_number(c, "r", cfg_path, 8));
  ad.config.use_rslora = c.value("use_rslora", false);
  ad.config.target_modules.clear();
  if (c.contains("target_modules") && c["target_modules"].is_array())
    for (const auto& t : c["target_modules"])
      if (t.is_string()) ad.config.target_modules.push_back(t.get<std::string>());
  if (c.contains("target_modules") && c["target_modules"].is_string())
    ad.config.target_modules.push_back(c["target_modules"].get<std::string>());
  if (c.contains("base_model_name_or_path") && c["base_model_name_or_path"].is_string())
    ad.base_model = c["base_model_name_or_path"].get<std::string>();
  LVX_CHECK(std::isfinite(ad.config.alpha) && ad.config.alpha > 0, cfg_path,
            ": field 'lora_alpha' must be > 0, got ", ad.config.alpha);
  return ad;
}

// (lora_A, lora_B) of each module, by module path as saved.
using LoraPairs = std::map<std::string, std::pair<at::Tensor, at::Tensor>>;

// The adapter file's tensors paired by module path as saved; anything but lora_A/lora_B refused.
LoraPairs pair_lora_tensors(const TensorFile& f, const std::string& st_path) {
  LoraPairs pairs;
  for (const auto& [key, t] : f.tensors) {
    std::string path = key;
    LVX_CHECK(path.rfind(kPrefix, 0) == 0, st_path, ": tensor '", key, "' does not start with '",
              kPrefix, "' (not a PEFT LoRA adapter file)");
    path = path.substr(kPrefix.size());
    if (ends_with(path, ".lora_A.weight")) {
      pairs[path.substr(0, path.size() - 14)].first = t;
    } else if (ends_with(path, ".lora_B.weight")) {
      pairs[path.substr(0, path.size() - 14)].second = t;
    } else {
      LVX_FAIL(st_path, ": tensor '", key, "' is not a lora_A/lora_B weight (embedding LoRA, ",
               "DoRA magnitudes, biases and modules_to_save are not supported)");
    }
  }
  LVX_CHECK(!pairs.empty(), st_path, ": holds no LoRA tensors");
  return pairs;
}

// Aliases: a module reachable under two paths is in PyTorch's state_dict twice, and PEFT saves
// both (OpenFlamingo's lang_encoder.gated_cross_attn_layers.i is the same block as
// lang_encoder.<decoder layers>.i.gated_cross_attn_layer). A pair without a weight of its name
// that equals, tensor for tensor, a pair with one is such an alias: dropped.
void drop_aliases(LoraPairs& pairs, const StateDict& w) {
  auto has_weight = [&](const std::string& path) { return w.count(path + kWeight) > 0; };
  auto same = [](const at::Tensor& x, const at::Tensor& y) {
    return x.defined() && y.defined() && x.sizes() == y.sizes() &&
           x.scalar_type() == y.scalar_type() && at::equal(x, y);
  };
  for (auto it = pairs.begin(); it != pairs.end();) {
    bool alias = false;
    if (!has_weight(it->first))
      for (const auto& [other, ab] : pairs)
        if (has_weight(other) && same(ab.first, it->second.first) &&
            same(ab.second, it->second.second)) {
          alias = true;
          break;
        }
    it = alias ? pairs.erase(it) : std::next(it);
  }
}

// The prefix that makes every module path a weight of the model: "" when they already are;
// otherwise the one prefix (e.g. "language_model.") under which each of them is.
std::string model_prefix(const LoraPairs& pairs, const StateDict& w, const std::string& st_path) {
  auto fits = [&](const std::string& prefix) {
    for (const auto& [path, ab] : pairs)
      if (!w.count(prefix + path + kWeight)) return false;
    return true;
  };
  std::string prefix;
  if (!fits("")) {
    const std::string first = pairs.begin()->first + kWeight;
    std::vector<std::string> found;
    for (const auto& [name, t] : w)
      if (ends_with(name, "." + first) && fits(name.substr(0, name.size() - first.size())))
        found.push_back(name.substr(0, name.size() - first.size()));
    if (found.size() != 1) {
      std::string missing;
      int n = 0;
      for (const auto& [path, ab] : pairs)
        if (!w.count(path + kWeight) && n++ < 3) missing += "\n  " + kPrefix + path;
      LVX_FAIL(st_path, ": ", found.empty() ? "no" : "more than one",
               " way to match the adapter's modules to the weights of the model; modules ",
               "with no weight of that name:", missing);
    }
    prefix = found[0];
  }
  return prefix;
}

// Checks each pair is complete, floating point and fits its weight, then adds it as a layer.
void add_lora_layers(LoraAdapter& ad, const LoraPairs& pairs, const StateDict& w,
                     const std::string& prefix, const std::string& st_path) {
  for (auto& [path, ab] : pairs) {
    const std::string name = prefix + path + kWeight;
    const at::Tensor& wt = w.at(name);
    LVX_CHECK(ab.first.defined() && ab.second.defined(), st_path, ": module '", path, "' has ",
              ab.first.defined() ? "lora_A but no lora_B" : "lora_B but no lora_A");
    const at::Tensor &a = ab.first, &b = ab.second;
    LVX_CHECK(wt.dim() == 2 && a.dim() == 2 && b.dim() == 2 && a.size(0) == b.size(1) &&
                  a.size(1) == wt.size(1) && b.size(0) == wt.size(0) && a.size(0) >= 1,
              st_path, ": module '", path, "': lora_A ", a.sizes(), " and lora_B ", b.sizes(),
              " do not fit the weight ", name, " ", wt.sizes(), " (expected [r, in] and [out, r])");
    LVX_CHECK(at::isFloatingType(a.scalar_type()) && at::isFloatingType(b.scalar_type()), st_path,
              ": module '", path, "': lora tensors must be floating point");
    LoraLayer l;
    l.a = a.to(placement(w, wt), at::kFloat).contiguous();
    l.b = b.to(placement(w, wt), at::kFloat).contiguous();
    l.scale = ad.config.scale(a.size(0));
    ad.layers.emplace(name, std::move(l));
  }
}

}  // namespace

double LoraConfig::scale(int64_t rank) const {
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank))
                    : alpha / static_cast<double>(rank);
}

int64_t LoraAdapter::parameters() const {
  int64_t n = 0;
  for (const auto& [name, l] : layers) n += l.a.numel() + l.b.numel();
  return n;
}

std::string lora_a_name(const std::string& weight) { return module_of(weight) + ".lora_A.weight"; }
std::string lora_b_name(const std::string& weight) { return module_of(weight) + ".lora_B.weight"; }

std::vector<std::string> lora_targets(Model& model, const LoraConfig& cfg,
                                      const std::string& where) {
  LVX_CHECK(cfg.r >= 1, where, ".r: must be >= 1, got ", cfg.r);
  LVX_CHECK(std::isfinite(cfg.alpha) && cfg.alpha > 0, where, ".alpha: must be > 0, got ",
            cfg.alpha);
  LVX_CHECK(!cfg.target_modules.empty(), where,
            ".target_modules: empty (name modules such as q_proj, v_proj, or all-linear)");
  const bool all_linear = cfg.target_modules.size() == 1 && cfg.target_modules[0] == "all-linear";
  std::set<std::string> chosen;
  std::vector<std::string> candidates;
  for (const std::string& name : linear_weights(model))
    if (model.trainable(name)) candidates.push_back(name);
  if (all_linear) {
    for (const auto& n : candidates)
      if (!is_output_head(module_of(n))) chosen.insert(n);
  } else {
    for (const std::string& t : cfg.target_modules) {
      LVX_CHECK(t != "all-linear", where, ".target_modules: all-linear must be the only entry");
      LVX_CHECK(!is_embedding(t), where, ".target_modules: '", t, "' is an embedding table; ",
                "lvx adapts linear weights only");
      size_t hits = 0;
      for (const auto& n : candidates)
        if (peft_matches(module_of(n), t)) chosen.insert(n), ++hits;
      if (hits == 0) {
        std::set<std::string> known;
        for (const auto& n : candidates) known.insert(last_component(module_of(n)));
        std::string list;
        for (const auto& k : known) list += (list.empty() ? "" : ", ") + k;
        LVX_FAIL(where, ".target_modules: '", t, "' matches no linear weight of this ",
                 model.family().display_name(), " model outside the vision tower (modules: ", list,
                 ", or all-linear)");
      }
    }
  }
  LVX_CHECK(!chosen.empty(), where, ".target_modules: selects no weight of this ",
            model.family().display_name(), " model");
  return {chosen.begin(), chosen.end()};
}

LoraAdapter init_lora(Model& model, const LoraConfig& cfg, uint64_t seed,
                      const std::string& base_model) {
  LoraAdapter ad;
  ad.config = cfg;
  ad.base_model = base_model;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::NoGradGuard ng;
  for (const std::string& name : lora_targets(model, cfg)) {
    const at::Tensor& w = model.parameters().at(name);
    const int64_t out = w.size(0), in = w.size(1);
    // kaiming_uniform_(a=√5) on [r, in]: gain √(2 / (1 + 5)), bound gain·√(3 / in) = 1/√in.
    const double bound = 1.0 / std::sqrt(static_cast<double>(in));
    const at::Device dev = placement(model.parameters(), w);
    LoraLayer l;
    l.a = (at::rand({cfg.r, in}, gen, at::TensorOptions().dtype(at::kFloat)) * (2 * bound) - bound)
              .to(dev);
    l.b = at::zeros({out, cfg.r}, at::TensorOptions().dtype(at::kFloat).device(dev));
    l.scale = cfg.scale(cfg.r);
    ad.layers.emplace(name, std::move(l));
  }
  return ad;
}

LoraAdapter load_lora(const std::string& dir, Model& model) {
  return load_lora(dir, model.parameters());
}

LoraAdapter load_lora(const std::string& dir, const StateDict& w) {
  const std::string cfg_path = dir + "/adapter_config.json";
  const std::string st_path = dir + "/adapter_model.safetensors";
  LVX_CHECK(fs::is_directory(dir), "--adapter: ", dir, " is not a directory (expected PEFT's ",
            "adapter_config.json and adapter_model.safetensors)");
  const nlohmann::json c = read_json_file(cfg_path, "adapter config");
  check_adapter_config(c, cfg_path);
  LoraAdapter ad = adapter_from_config(c, cfg_path);
  const TensorFile f = load_safetensors(st_path);
  LoraPairs pairs = pair_lora_tensors(f, st_path);
  drop_aliases(pairs, w);
  const std::string prefix = model_prefix(pairs, w, st_path);
  add_lora_layers(ad, pairs, w, prefix, st_path);
  return ad;
}

nlohmann::json adapter_config_json(const LoraAdapter& ad, Model& model) {
  std::set<std::string> adapted;
  for (const auto& [name, l] : ad.layers) adapted.insert(module_of(name));
  std::vector<std::string> linear;
  for (const auto& n : linear_weights(model)) linear.push_back(module_of(n));
  std::set<std::string> modules;  // every module that holds a parameter
  for (const auto& [name, t] : model.parameters())
    modules.insert(name.find('.') == std::string::npos ? name : name.substr(0, name.rfind('.')));
  // What PEFT's suffix rule would select with the configured list.
  nlohmann::json targets;
  const bool all_linear =
      ad.config.target_modules.size() == 1 && ad.config.target_modules[0] == "all-linear";
  if (!all_linear && !ad.config.target_modules.empty()) {
    std::set<std::string> peft;
    for (const auto& m : linear)
      for (const auto& t : ad.config.target_modules)
        if (peft_matches(m, t)) peft.insert(m);
    if (peft == adapted) {
      std::vector<std::string> sorted = ad.config.target_modules;
      std::sort(sorted.begin(), sorted.end());
      targets = sorted;
    }
  }
  if (targets.is_null()) {
    std::set<std::string> patterns;
    for (const auto& m : adapted) patterns.insert(path_pattern(m));
    std::string re = join_alternatives(patterns);
    const std::regex rx(re);
    bool exact = true;
    for (const auto& m : modules)
      exact = exact && std::regex_match(m, rx) == (adapted.count(m) > 0);
    if (!exact) {  // layer indices cannot be generalised: the paths themselves
      std::set<std::string> paths;
      for (const auto& m : adapted) paths.insert(regex_escape(m));
      re = join_alternatives(paths);
    }
    targets = re;
  }
  int64_t r = ad.config.r;
  if (!ad.layers.empty()) r = ad.layers.begin()->second.a.size(0);
  return {{"alpha_pattern", nlohmann::json::object()},
          {"auto_mapping", nullptr},
          {"base_model_name_or_path",
           ad.base_model.empty() ? nlohmann::json(nullptr) : nlohmann::json(ad.base_model)},
          {"bias", "none"},
          {"corda_config", nullptr},
          {"eva_config", nullptr},
          {"exclude_modules", nullptr},
          {"fan_in_fan_out", false},
          {"inference_mode", true},
          {"init_lora_weights", true},
          {"layer_replication", nullptr},
          {"layers_pattern", nullptr},
          {"layers_to_transform", nullptr},
          {"loftq_config", nlohmann::json::object()},
          {"lora_alpha", ad.config.alpha},
          {"lora_bias", false},
          {"lora_dropout", ad.config.dropout},
          {"megatron_config", nullptr},
          {"megatron_core", "megatron.core"},
          {"modules_to_save", nullptr},
          {"peft_type", "LORA"},
          {"qalora_group_size", 16},
          {"r", r},
          {"rank_pattern", nlohmann::json::object()},
          {"revision", nullptr},
          {"target_modules", targets},
          {"target_parameters", nullptr},
          {"task_type", nullptr},
          {"trainable_token_indices", nullptr},
          {"use_dora", false},
          {"use_qalora", false},
          {"use_rslora", ad.config.use_rslora}};
}

std::map<std::string, at::Tensor> adapter_tensors(const LoraAdapter& ad) {
  std::map<std::string, at::Tensor> t;
  for (const auto& [name, l] : ad.layers) {
    const std::string m = kPrefix + module_of(name);
    t[m + ".lora_A.weight"] = l.a.detach().to(at::kCPU, at::kFloat).contiguous();
    t[m + ".lora_B.weight"] = l.b.detach().to(at::kCPU, at::kFloat).contiguous();
  }
  return t;
}

void save_lora(const std::string& dir, const LoraAdapter& ad, Model& model) {
  fs::create_directories(dir);
  save_safetensors(dir + "/adapter_model.safetensors", adapter_tensors(ad), {{"format", "pt"}});
  const std::string path = dir + "/adapter_config.json";
  std::ofstream f(path, std::ios::trunc);
  f << adapter_config_json(ad, model).dump(2) << "\n";
  LVX_CHECK(f.good(), path, ": cannot write");
}

at::Tensor lora_weight(const at::Tensor& w, const LoraLayer& l) {
  const at::Tensor delta = at::matmul(l.b, l.a) * l.scale;
  if (w.scalar_type() == at::kFloat) return w + delta;
  return (w.to(at::kFloat) + delta).to(w.scalar_type());
}

void merge_lora(StateDict& weights, const LoraAdapter& ad) {
  at::NoGradGuard ng;
  for (const auto& [name, l] : ad.layers) {
    auto it = weights.find(name);
    LVX_CHECK(it != weights.end(), "adapter: the model has no weight ", name);
    it->second = lora_weight(it->second, l).contiguous();
  }
}

void merge_adapter(Model& model, const std::string& dir) {
  merge_lora(model.parameters(), load_lora(dir, model));
}

// ---- the activation path --------------------------------------------------------------------

namespace {

// Which weights alive LoraModels adapt, by the weight's TensorImpl (the base model's tensors are
// never replaced while a LoraModel wraps it), with where that model keeps A and B.
struct Route {
  const StateDict* params = nullptr;
  std::string a, b;
  double scale = 1;
};

struct Routes {
  std::shared_mutex mu;
  std::unordered_map<const c10::TensorImpl*, Route> by_weight;
  std::atomic<size_t> size{0};  // read without the lock: no LoRA model, no lookup
};

Routes& routes() {
  static Routes r;
  return r;
}

}  // namespace

at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias) {
  at::Tensor y = kernels::linear(x, w, bias);
  Routes& rs = routes();
  if (rs.size.load(std::memory_order_acquire) == 0) return y;
  Route r;
  {
    std::shared_lock lock(rs.mu);
    auto it = rs.by_weight.find(w.unsafeGetTensorImpl());
    if (it == rs.by_weight.end()) return y;
    r = it->second;
  }
  const auto dt = x.scalar_type();
  const at::Tensor a = r.params->at(r.a).to(dt), b = r.params->at(r.b).to(dt);
  return y + at::linear(at::linear(x, a), b) * r.scale;
}

// ---- LoraModel -----------------------------------------------------------------------------

LoraModel::LoraModel(std::unique_ptr<Model> base, LoraAdapter adapter)
    : base_(std::move(base)), adapter_(std::move(adapter)) {
  StateDict& params = base_->parameters();
  for (auto& [name, l] : adapter_.layers) {
    LVX_CHECK(params.count(name), "LoRA: the model has no weight ", name);
    params[lora_a_name(name)] = l.a;
    params[lora_b_name(name)] = l.b;
  }
  route();
}

void LoraModel::route() const {
  Routes& rs = routes();
  const StateDict& params = base_->parameters();
  std::unique_lock lock(rs.mu);
  for (const c10::TensorImpl* w : routed_) rs.by_weight.erase(w);
  routed_.clear();
  for (const auto& [name, l] : adapter_.layers) {
    const c10::TensorImpl* w = params.at(name).unsafeGetTensorImpl();
    LVX_CHECK(rs.by_weight.count(w) == 0, "LoRA: ", name, " is already adapted by another model");
    rs.by_weight[w] = Route{&params, lora_a_name(name), lora_b_name(name), l.scale};
    routed_.push_back(w);
  }
  rs.size.store(rs.by_weight.size(), std::memory_order_release);
}

LoraModel::~LoraModel() {
  Routes& rs = routes();
  std::unique_lock lock(rs.mu);
  for (const c10::TensorImpl* w : routed_) rs.by_weight.erase(w);
  rs.size.store(rs.by_weight.size(), std::memory_order_release);
}

bool LoraModel::trainable(const std::string& name) const {
  return ends_with(name, ".lora_A.weight") || ends_with(name, ".lora_B.weight");
}

ModelOutputs LoraModel::forward(const ModelInputs& in, const Parallel& par) const {
  route();
  return base_->forward(in, par);
}

at::Tensor LoraModel::prefill(const ModelInputs& in, const Parallel& par,
                              DecodeCache& cache) const {
  route();
  return base_->prefill(in, par, cache);
}

at::Tensor LoraModel::decode_step(const at::Tensor& tokens, const Parallel& par,
                                  DecodeCache& cache) const {
  route();
  return base_->decode_step(tokens, par, cache);
}

}  // namespace lvx::models
