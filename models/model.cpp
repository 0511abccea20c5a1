#include "models/model.h"

#include <algorithm>
#include <cstdlib>

#include "kernels/linear.h"
#include "models/family.h"
#include "models/lora.h"
#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/common/host_memory.h"

namespace lvx::models {

at::Tensor Model::prefill(const ModelInputs&, const Parallel&, DecodeCache&) const {
  LVX_FAIL("generation is not implemented for the ", family().display_name(),
           " family yet (lvx qa needs it)");
}

at::Tensor Model::decode_step(const at::Tensor&, const Parallel&, DecodeCache&) const {
  LVX_FAIL("generation is not implemented for the ", family().display_name(),
           " family yet (lvx qa needs it)");
}

at::Tensor Model::extend(const at::Tensor&, const Parallel&, DecodeCache&) const {
  LVX_FAIL("extending a kept prompt is not implemented for the ", family().display_name(),
           " family");
}

void Model::prefill_media(const ModelInputs&, const Parallel&, DecodeCache&) const {
  LVX_FAIL("prefilling a prompt in chunks is not implemented for the ", family().display_name(),
           " family");
}

at::Tensor Model::decode_rows(const at::Tensor& tokens, const Parallel& par,
                              const std::vector<DecodeCache*>& caches) const {
  LVX_CHECK(tokens.dim() == 1 && tokens.size(0) == static_cast<int64_t>(caches.size()),
            "decode_rows: expected one token per row (", caches.size(), "), got ", tokens.sizes());
  std::vector<at::Tensor> logits;
  for (size_t r = 0; r < caches.size(); ++r)
    logits.push_back(
        decode_step(tokens.narrow(0, static_cast<int64_t>(r), 1).contiguous(), par, *caches[r]));
  return at::cat(logits, 0);
}

at::Tensor Model::extend_rows(const std::vector<at::Tensor>& tokens, const Parallel& par,
                              const std::vector<DecodeCache*>& caches) const {
  LVX_CHECK(tokens.size() == caches.size(), "extend_rows: ", tokens.size(), " rows of tokens for ",
            caches.size(), " caches");
  // The one-token rows (decode steps) in one decode_rows call, the others each extended alone.
  std::vector<at::Tensor> logits(caches.size()), one_token;
  std::vector<DecodeCache*> stepping;
  std::vector<size_t> at;
  for (size_t r = 0; r < caches.size(); ++r)
    if (tokens[r].numel() == 1) {
      one_token.push_back(tokens[r].view({1}));
      stepping.push_back(caches[r]);
      at.push_back(r);
    }
  if (!stepping.empty()) {
    const at::Tensor l = stepping.size() == 1 ? decode_step(one_token[0], par, *stepping[0])
                                              : decode_rows(at::cat(one_token), par, stepping);
    for (size_t i = 0; i < at.size(); ++i) logits[at[i]] = l.narrow(0, static_cast<int64_t>(i), 1);
  }
  for (size_t r = 0; r < caches.size(); ++r)
    if (tokens[r].numel() != 1) logits[r] = extend(tokens[r].view({1, -1}), par, *caches[r]);
  return at::cat(logits, 0);
}

at::Tensor last_token_logits(const at::Tensor& hidden, const at::Tensor& positions, int64_t length,
                             const at::Tensor& head, dist::ProcessGroup& pg) {
  const int64_t B = hidden.size(0);
  at::Tensor logits = at::zeros({B, head.size(0)}, hidden.options().dtype(at::kFloat));
  // The row is found on the host (positions are host metadata): no device sync, no nonzero().
  LVX_CHECK(positions.device().is_cpu() && positions.scalar_type() == at::kLong,
            "last_token_logits: positions must be int64 on the host, got ", positions.scalar_type(),
            " on ", positions.device());
  const at::Tensor p = positions.contiguous();
  const int64_t* pp = p.data_ptr<int64_t>();
  for (int64_t i = 0; i < p.numel(); ++i)
    if (pp[i] == length - 1)  // lora_linear: an adapter on lm_head applies while it trains
      logits = lora_linear(hidden.select(1, i), head, c10::nullopt).to(at::kFloat);
  // One rank holds the row; the others add zeros (exact).
  pg.all_reduce(logits);
  return logits;
}

bool trains_under(const std::string& policy, const Model& model, const std::string& name) {
  if (policy == "none") return true;
  if (policy == "vision") return model.trainable(name);
  return model.trains_cross_only(name);
}

namespace {

std::unique_ptr<Model> make_model(const Checkpoint& ck, at::ScalarType dtype, at::Device device) {
  return family_of_config(ck.config, ck.dir + "/config.json").load(ck, dtype, device);
}

// Refuses a load that cannot fit before reading anything (the OOM killer would end it halfway,
// with nothing said): the parameters converted or moved to the host in `dtype` are this rank's own
// (every local rank holds a copy); those used in place from the mapped files are one copy per
// host (the page cache); both against the memory available now (src/common/host_memory.h), with
// a margin for what the first step allocates.
void check_host_memory(const CheckpointIndex& index, Model& meta, at::ScalarType dtype,
                       at::Device device, const DeferParameter& defer) {
  if (!device.is_cpu()) return;
  uint64_t own = 0, shared = 0, stored = 0;  // stored: all of them in the files' own dtypes
  int64_t params = 0;
  for (auto& [name, t] : meta.parameters()) {
    if (defer && defer(meta, name)) continue;
    const uint64_t n = static_cast<uint64_t>(t.numel());
    const at::ScalarType in_file = index.meta.tensors.at(name).scalar_type();
    params += t.numel();
    (in_file == dtype ? shared : own) += n * c10::elementSize(dtype);
    stored += n * c10::elementSize(in_file);
  }
  const char* env = std::getenv("LOCAL_WORLD_SIZE");
  const uint64_t local = static_cast<uint64_t>(std::max<int64_t>(1, env ? std::atoll(env) : 1));
  const uint64_t margin = uint64_t{256} << 20;
  const uint64_t need = own * local + shared;
  const uint64_t avail = available_host_memory();
  if (avail == 0 || need + margin <= avail) return;
  char b1[32], b2[32], b3[32];
  LVX_FAIL(index.meta.dir, ": not enough memory: the weights need ", human_bytes(need, b1), " in ",
           dtype_name(dtype), " (", params, " parameters",
           local > 1 && own > 0
               ? str("; converted, so each of ", local, " local ranks holds a copy")
               : std::string(),
           ") but this machine has ", human_bytes(avail, b2),
           " available (MemAvailable, or its cgroup's limit)",
           own > 0 ? str("; in the checkpoint's own dtype they are used in place (",
                         human_bytes(stored, b3), ", one copy for every local rank)")
                   : std::string(),
           "; use fewer local ranks or a machine with more memory");
}

}  // namespace

std::unique_ptr<Model> load_model(const std::string& dir, at::ScalarType dtype, at::Device device,
                                  const DeferParameter& defer,
                                  std::shared_ptr<const CheckpointIndex>* index_out) {
  // The model is built on meta from the files' headers (every name, shape and dtype checked),
  // then each parameter comes from the mapped files on its own (load_parameter): in place when
  // it keeps its stored dtype on the CPU (local ranks share those pages), else converted and
  // moved, so host memory never holds a second copy of the checkpoint.
  auto index = std::make_shared<CheckpointIndex>(load_checkpoint_index(dir));
  std::unique_ptr<Model> model = make_model(index->meta, dtype, at::kMeta);
  if (device.is_meta()) {  // shapes only (lvx plan): no file is mapped, no byte read
    for (auto& [name, t] : model->parameters()) t = at::empty(t.sizes(), t.options().dtype(dtype));
    if (index_out != nullptr) *index_out = std::move(index);
    return model;
  }
  check_host_memory(*index, *model, dtype, device, defer);
  map_checkpoint_files(*index);
  for (auto& [name, t] : model->parameters())
    if (!defer || !defer(*model, name)) t = load_parameter(*index, name, dtype, device);
  if (index_out != nullptr) *index_out = std::move(index);
  return model;
}

std::unique_ptr<Model> load_model_shapes(const std::string& dir) {
  const std::string where = dir + "/config.json";
  return model_from_config(read_json_file(where, "model config", uint64_t{16} << 20), where, dir);
}

std::unique_ptr<Model> model_from_config(const nlohmann::json& config, const std::string& where,
                                         const std::string& dir) {
  Checkpoint ck;
  ck.dir = dir;
  ck.config = config;
  const Family& family = family_of_config(ck.config, where);
  const auto meta = at::TensorOptions().dtype(at::kFloat).device(at::kMeta);
  for (const auto& [name, shape] : family.parameter_shapes(ck.config, where))
    ck.tensors[name] = at::empty(shape, meta);
  return family.load(ck, at::kFloat, at::kMeta);
}

int64_t layer_number_after(const std::string& name, const std::string& prefix) {
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return -1;
  int64_t n = 0;
  size_t i = prefix.size();
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9' && i - prefix.size() < 9; ++i)
    n = n * 10 + (name[i] - '0');
  return i > prefix.size() && i < name.size() && name[i] == '.' ? n : -1;
}

void check_named_inputs(const ModelInputs& in, const std::vector<std::string>& known,
                        const std::string& model) {
  std::string reads = "input_ids, pixel_values, labels";
  for (const std::string& k : known) reads += ", " + k;
  for (const auto& [name, t] : in.named)
    LVX_CHECK(std::find(known.begin(), known.end(), name) != known.end(), model,
              ": unknown input '", name, "' (this family reads ", reads, ")");
}

ModelConfig planner_model_from_config(const nlohmann::json& j, const std::string& where) {
  LVX_CHECK(j.is_object(), where, ": expected a JSON object, got ", j.type_name());
  ModelConfig m = family_of_config(j, where).planner_model(j, where);
  const std::string dt = config_string_or(j, "torch_dtype", where, "bfloat16");
  m.dtype = dt == "float32" ? "fp32" : dt == "float16" ? "fp16" : "bf16";
  return m;
}

}  // namespace lvx::models
