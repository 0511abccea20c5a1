// The placement check (issue 21, "Every job on the device"): both model families' forward,
// backward, prefill and pass-Q decode step run with every weight and every frame on PyTorch's
// `meta` device, where each op that mixes devices fails ("Expected all tensors to be on the same
// device ... meta and cpu"), so a tensor a model creates with default options (on the CPU) instead
// of its related tensor's options is found here, on a machine without a GPU, as it would fail on
// CUDA. lvx's attention runs through its shape-only meta entry (kernels/attention_meta.cpp), the
// world-1 process group copies nothing it would not copy on a device. input_ids stay on the host:
// they are the step's metadata (models/model.h). Then a CPU-created tensor planted in a model
// (a weight, the frames, a kernel's mask) is shown to be caught.
#include <gtest/gtest.h>
#include <torch/library.h>

#include <cctype>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kernels/attention.h"
#include "models/decode.h"
#include "models/init.h"
#include "models/model.h"
#include "models/openflamingo/model.h"
#include "src/common/device_index.h"
#include "src/common/error.h"
#include "src/dist/process_group.h"
#include "tests/build_paths.h"
#include "tests/model_conformance.h"

// Meta kernels that libtorch's C++ library lacks (PyTorch registers these in Python,
// torch/_meta_registrations.py): shapes only, after the same device check as the CPU/CUDA
// kernels ("Expected all tensors to be on the same device"), so that a tensor on another device
// fails here as it would on CUDA. Test-only: they live in this binary.
namespace {

void same_device(const at::Tensor& a, const at::Tensor& b, const char* op, const char* arg) {
  TORCH_CHECK(lvx::same_device(a.device(), b.device()),
              "Expected all tensors to be on the same device, but found at least two devices, ",
              a.device(), " and ", b.device(), "! (when checking argument ", arg, " of ", op, ")");
}

at::Tensor index_select_meta(const at::Tensor& self, int64_t dim, const at::Tensor& index) {
  same_device(self, index, "index_select", "index");
  auto sizes = self.sizes().vec();
  if (!sizes.empty())
    sizes[static_cast<size_t>(c10::maybe_wrap_dim(dim, self.dim()))] = index.numel();
  return at::empty(sizes, self.options());
}

at::Tensor embedding_dense_backward_meta(const at::Tensor& grad, const at::Tensor& indices,
                                         c10::SymInt num_weights, c10::SymInt, bool) {
  same_device(grad, indices, "embedding_dense_backward", "indices");
  return at::empty({num_weights.expect_int(), grad.size(-1)}, grad.options());
}

at::Tensor& masked_fill_scalar_meta(at::Tensor& self, const at::Tensor& mask, const at::Scalar&) {
  same_device(self, mask, "masked_fill_", "mask");
  return self;
}

at::Tensor& masked_fill_tensor_meta(at::Tensor& self, const at::Tensor& mask,
                                    const at::Tensor& value) {
  same_device(self, mask, "masked_fill_", "mask");
  if (value.dim() > 0) same_device(self, value, "masked_fill_", "value");
  return self;
}

at::Tensor nan_to_num_meta(const at::Tensor& self, std::optional<double>, std::optional<double>,
                           std::optional<double>) {
  return at::empty_like(self);
}

// Convolutions on a backend other than CPU/CUDA go to the *_overrideable ops (the patch
// embeddings of both vision towers); non-transposed only.
at::Tensor convolution_meta(const at::Tensor& input, const at::Tensor& weight,
                            const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                            c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                            bool transposed, c10::SymIntArrayRef, c10::SymInt) {
  same_device(input, weight, "convolution", "weight");
  if (bias && bias->defined()) same_device(input, *bias, "convolution", "bias");
  TORCH_CHECK(!transposed, "convolution_meta: transposed convolutions are not needed here");
  std::vector<int64_t> out{input.size(0), weight.size(0)};
  for (int64_t i = 2; i < input.dim(); ++i) {
    const size_t j = static_cast<size_t>(i - 2);
    const int64_t s = stride[j].expect_int(), p = padding[j].expect_int(),
                  d = dilation[j].expect_int(), k = weight.size(i);
    out.push_back((input.size(i) + 2 * p - d * (k - 1) - 1) / s + 1);
  }
  return at::empty(out, input.options());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_meta(
    const at::Tensor& grad, const at::Tensor& input, const at::Tensor& weight, c10::SymIntArrayRef,
    c10::SymIntArrayRef, c10::SymIntArrayRef, bool, c10::SymIntArrayRef, c10::SymInt,
    std::array<bool, 3> mask) {
  same_device(grad, input, "convolution_backward", "input");
  same_device(grad, weight, "convolution_backward", "weight");
  return {mask[0] ? at::empty_like(input) : at::Tensor(),
          mask[1] ? at::empty_like(weight) : at::Tensor(),
          mask[2] ? at::empty({weight.size(0)}, weight.options()) : at::Tensor()};
}

// LayerNorm (on meta, ATen's composite path would reach native_batch_norm, which has none).
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_meta(const at::Tensor& input,
                                                               c10::SymIntArrayRef normalized,
                                                               const std::optional<at::Tensor>& w,
                                                               const std::optional<at::Tensor>& b,
                                                               double) {
  for (const auto* t : {&w, &b})
    if (*t && (*t)->defined()) same_device(input, **t, "native_layer_norm", "weight/bias");
  auto stat = input.sizes().vec();
  for (size_t i = stat.size() - normalized.size(); i < stat.size(); ++i) stat[i] = 1;
  const auto f32 = input.options().dtype(at::kFloat);
  return {at::empty_like(input), at::empty(stat, f32), at::empty(stat, f32)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward_meta(
    const at::Tensor& grad, const at::Tensor& input, c10::SymIntArrayRef, const at::Tensor& mean,
    const at::Tensor& rstd, const std::optional<at::Tensor>& w, const std::optional<at::Tensor>& b,
    std::array<bool, 3> mask) {
  same_device(grad, input, "native_layer_norm_backward", "input");
  same_device(grad, mean, "native_layer_norm_backward", "mean");
  same_device(grad, rstd, "native_layer_norm_backward", "rstd");
  return {mask[0] ? at::empty_like(input) : at::Tensor(),
          mask[1] && w && w->defined() ? at::empty_like(*w) : at::Tensor(),
          mask[2] && b && b->defined() ? at::empty_like(*b) : at::Tensor()};
}

// where: CUDA takes a 0-dim CPU tensor as a scalar, so does this check.
at::Tensor where_meta(const at::Tensor& cond, const at::Tensor& self, const at::Tensor& other) {
  for (const auto& [t, name] : {std::pair{&self, "self"}, std::pair{&other, "other"}})
    if (t->dim() > 0 || !t->device().is_cpu()) same_device(cond, *t, "where", name);
  const auto shape = at::infer_size(at::infer_size(cond.sizes(), self.sizes()), other.sizes());
  return at::empty(
      shape, self.options().dtype(at::promote_types(self.scalar_type(), other.scalar_type())));
}

at::Tensor& where_out_meta(const at::Tensor& cond, const at::Tensor& self, const at::Tensor& other,
                           at::Tensor& out) {
  const at::Tensor r = where_meta(cond, self, other);
  same_device(r, out, "where", "out");
  out.resize_(r.sizes());
  return out;
}

// Element-wise `.out` ops without a C++ meta kernel (abs.out, logical_not.out, ...), boxed: the
// inputs' broadcast shape, after the device check (0-dim CPU tensors pass, as on CUDA).
void elementwise_out_meta(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, n);
  at::Tensor out = args[n - 1].toTensor();
  std::vector<int64_t> shape;
  for (size_t i = 0; i + 1 < n; ++i) {
    if (!args[i].isTensor()) continue;
    const at::Tensor t = args[i].toTensor();
    if (t.dim() > 0 || !t.device().is_cpu())
      same_device(out, t, op.schema().name().c_str(), "input");
    shape = at::infer_size(shape, t.sizes());
  }
  out.resize_(shape);
  torch::jit::drop(*stack, n);
  torch::jit::push(*stack, out);
}

TORCH_LIBRARY_IMPL(aten, Meta, m) {
  for (const char* name : {"abs.out", "logical_not.out", "logical_and.out", "logical_or.out",
                           "logical_xor.out", "sign.out", "bitwise_not.out"})
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&elementwise_out_meta>());
  m.impl("where.self", TORCH_FN(where_meta));
  m.impl("where.self_out", TORCH_FN(where_out_meta));
  m.impl("native_layer_norm", TORCH_FN(layer_norm_meta));
  m.impl("native_layer_norm_backward", TORCH_FN(layer_norm_backward_meta));
  m.impl("convolution_overrideable", TORCH_FN(convolution_meta));
  m.impl("convolution_backward_overrideable", TORCH_FN(convolution_backward_meta));
  m.impl("index_select", TORCH_FN(index_select_meta));
  m.impl("embedding_dense_backward", TORCH_FN(embedding_dense_backward_meta));
  m.impl("masked_fill_.Scalar", TORCH_FN(masked_fill_scalar_meta));
  m.impl("masked_fill_.Tensor", TORCH_FN(masked_fill_tensor_meta));
  m.impl("nan_to_num", TORCH_FN(nan_to_num_meta));
}

}  // namespace

namespace lvx::models {
namespace {

const at::Device kMeta{at::kMeta};

Parallel single_rank(bool remat = false, bool recompute = false) {
  Parallel par;
  par.pg = dist::ProcessGroup::from_env();
  par.remat = remat;
  par.recompute_cross_kv = recompute;
  return par;
}

// mPLUG-Owl3 from models/init.h's tiny spec, loaded straight onto meta.
std::unique_ptr<Model> mplug_on_meta(const std::string& variant) {
  const std::string dir = (lvx::testing::workdir() / ("placement_mplug_" + variant)).string();
  TinyModelSpec spec;
  spec.words = {"red", "green"};
  spec.variant = variant;
  write_tiny_mplug_owl3(dir, spec);
  return load_model(dir, at::kFloat, kMeta);
}

// OpenFlamingo with a tiny decoder of each supported family, every weight created on meta.
std::unique_ptr<Model> openflamingo_on_meta(const std::string& lm, at::ScalarType dtype) {
  nlohmann::json text;
  std::string layers_attr;
  if (lm == "mpt") {
    text = {{"model_type", "mpt"}, {"d_model", 32}, {"n_layers", 2}, {"n_heads", 4}};
    layers_attr = "transformer.blocks";
  } else if (lm == "llama") {
    text = {{"model_type", "llama"},    {"hidden_size", 32},        {"num_hidden_layers", 2},
            {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"intermediate_size", 64}};
    layers_attr = "model.layers";
  } else {
    text = {{"model_type", "gpt_neox"}, {"hidden_size", 32},       {"num_hidden_layers", 2},
            {"num_attention_heads", 4}, {"intermediate_size", 64}, {"rotary_pct", 0.5}};
    layers_attr = "gpt_neox.layers";
  }
  const nlohmann::json config = {
      {"model_type", "openflamingo"},
      {"vision_config",
       {{"width", 32},
        {"layers", 2},
        {"heads", 2},
        {"mlp_width", 64},
        {"image_size", 32},
        {"patch_size", 8}}},
      {"perceiver_config",
       {{"depth", 1}, {"heads", 2}, {"dim_head", 16}, {"num_latents", 4}, {"ff_mult", 2}}},
      {"cross_attn_config", {{"heads", 2}, {"dim_head", 16}}},
      {"decoder_layers_attr", layers_attr},
      {"vocab_size", 64},
      {"media_token_id", 60},
      {"text_config", text},
      {"cross_attn_layers", {0, 1}}};
  Checkpoint ck;
  ck.dir = "<meta openflamingo " + lm + ">";
  ck.config = config;
  for (const auto& [name, shape] : openflamingo_shapes(openflamingo_config(config, ck.dir)))
    ck.tensors[name] = at::empty(shape, at::TensorOptions().dtype(at::kFloat).device(kMeta));
  return std::make_unique<OpenFlamingo>(ck, dtype, kMeta);
}

// Two images in a prompt of 12 tokens (host ids), their pixels ([2, 3, S, S]) on meta.
ModelInputs inputs(const Model& m, int64_t image_size = 32) {
  const int64_t img = m.media_token_id();
  const std::vector<int64_t> ids{1, img, 2, 3, 4, img, 5, 6, 7, 8, 9, 10};
  ModelInputs in;
  in.input_ids = at::tensor(ids, at::kLong).unsqueeze(0);
  in.pixel_values = at::empty({2, 3, image_size, image_size},
                              at::TensorOptions().dtype(at::kFloat).device(kMeta));
  return in;
}

// Forward + backward, prefill + two decode steps: every result on meta.
void run_everything_on_meta(Model& m, const Parallel& par, int64_t image_size = 32) {
  for (auto& [name, t] : m.parameters()) {
    ASSERT_TRUE(t.is_meta()) << name << " is on " << t.device();
    if (m.trainable(name)) t.requires_grad_(true);
  }
  const ModelInputs in = inputs(m, image_size);
  const ModelOutputs out = m.forward(in, par);
  EXPECT_TRUE(out.logits.is_meta()) << out.logits.device();
  EXPECT_EQ(out.logits.size(0), 1);
  EXPECT_EQ(out.logits.size(1), 12);
  out.logits.to(at::kFloat).sum().backward();
  size_t grads = 0;
  for (auto& [name, t] : m.parameters()) {
    if (!m.trainable(name)) continue;
    ASSERT_TRUE(t.grad().defined()) << name << " got no gradient";
    EXPECT_TRUE(t.grad().is_meta()) << name << "'s gradient is on " << t.grad().device();
    t.mutable_grad() = at::Tensor();
    t.requires_grad_(false);
    ++grads;
  }
  EXPECT_GT(grads, 10u);

  DecodeCache cache;
  at::Tensor logits = m.prefill(in, par, cache);
  EXPECT_TRUE(logits.is_meta()) << logits.device();
  const std::vector<DecoderLayerAttention> attentions = m.layer_attentions();
  ASSERT_EQ(attentions.size(), cache.prompt.size());
  for (size_t l = 0; l < cache.prompt.size(); ++l) {
    // Every layer with a self-attention keeps its prompt K (Mllama's cross layers have none).
    if (attentions[l].self) {
      EXPECT_TRUE(cache.prompt[l].k.is_meta()) << "layer " << l << " prompt K";
    }
    if (cache.visual[l].k.defined()) {
      EXPECT_TRUE(cache.visual[l].k.is_meta()) << "layer " << l;
    }
  }
  EXPECT_TRUE(cache.sees_media.is_meta());
  // Tokens are host values in generation (runtime/generate.cpp): the step moves them.
  for (int step = 0; step < 2; ++step) {
    logits = m.decode_step(at::tensor(std::vector<int64_t>{3}, at::kLong), par, cache);
    EXPECT_TRUE(logits.is_meta()) << logits.device();
    EXPECT_EQ(logits.size(0), 1);
  }
  // A prompt without images takes the text-only branches (no media slots).
  ModelInputs text;
  text.input_ids = at::tensor(std::vector<int64_t>{1, 2, 3, 4, 5}, at::kLong).unsqueeze(0);
  EXPECT_TRUE(m.forward(text, par).logits.is_meta());
  DecodeCache text_cache;
  EXPECT_TRUE(m.prefill(text, par, text_cache).is_meta());
  EXPECT_TRUE(text_cache.sees_media.is_meta());
  EXPECT_TRUE(
      m.decode_step(at::tensor(std::vector<int64_t>{3}, at::kLong), par, text_cache).is_meta());
}

TEST(Placement, MplugOwl3RunsForwardBackwardPrefillDecodeOnMeta) {
  for (const std::string variant : {"240728", "241101"})
    for (const bool remat : {false, true}) {
      SCOPED_TRACE(variant + (remat ? " remat+recompute" : ""));
      auto m = mplug_on_meta(variant);
      run_everything_on_meta(*m, single_rank(remat, remat));
    }
}

// Off the CPU, load_model builds the model on meta from the files' headers and reads each
// parameter on its own: the same parameters (names, shapes, dtypes) as the CPU load.
TEST(Placement, LoadingStraightToADeviceGivesTheCpuLoadsParameters) {
  const std::string dir = (lvx::testing::workdir() / "placement_load").string();
  TinyModelSpec spec;
  spec.words = {"red"};
  write_tiny_mplug_owl3(dir, spec);
  // The same tensors in 3 shards (model.safetensors.index.json).
  const std::string sharded = dir + "_sharded";
  const Checkpoint ck = load_checkpoint(dir);
  save_checkpoint(sharded, ck.config, ck.tensors, 3);
  std::filesystem::copy_file(dir + "/tokenizer.json", sharded + "/tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  for (const auto& [from, dt] : {std::pair{dir, at::kFloat}, std::pair{sharded, at::kBFloat16}}) {
    const auto cpu = load_model(dir, dt), meta = load_model(from, dt, kMeta);
    ASSERT_EQ(cpu->parameters().size(), meta->parameters().size());
    for (const auto& [name, t] : cpu->parameters()) {
      const at::Tensor& m = meta->parameters().at(name);
      EXPECT_TRUE(m.is_meta()) << name;
      EXPECT_EQ(m.sizes(), t.sizes()) << name;
      EXPECT_EQ(m.scalar_type(), dt) << name;
      EXPECT_TRUE(m.is_contiguous()) << name;
    }
  }
}

TEST(Placement, OpenFlamingoRunsForwardBackwardPrefillDecodeOnMeta) {
  for (const std::string lm : {"mpt", "llama", "gpt_neox"})
    for (const at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(lm + " " + at::toString(dt) + (lm == "llama" ? " remat+recompute" : ""));
      auto m = openflamingo_on_meta(lm, dt);
      run_everything_on_meta(*m, single_rank(lm == "llama", lm == "llama"));
    }
}

// The message of what `f` throws ("" when nothing is thrown).
template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// ATen names the devices "meta" / "cpu" (or the types MetaFloatType / CPUFloatType).
bool names_both_devices(std::string msg) {
  for (char& c : msg) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return msg.find("meta") != std::string::npos && msg.find("cpu") != std::string::npos;
}

// A tensor made with default options (on the CPU) where the model's tensors live elsewhere: the
// check must fail, naming both devices. Planted as what a default-options bug makes: a weight,
// the frames, a kernel's mask.
TEST(Placement, CatchesACpuTensorPlantedInTheModel) {
  const Parallel par = single_rank();
  {  // an RMSNorm weight of a decoder layer, created like `at::ones(shape)` would make it
    auto m = mplug_on_meta("240728");
    at::Tensor& w =
        m->parameters().at("language_model.model.layers.1.post_attention_layernorm.weight");
    w = at::ones(w.sizes(), at::kFloat);
    const std::string msg = error_of([&] { m->forward(inputs(*m), par); });
    EXPECT_TRUE(names_both_devices(msg)) << msg;
  }
  {  // a cross-attention gate of OpenFlamingo, the same way: caught in the decode step too
    auto m = openflamingo_on_meta("mpt", at::kFloat);
    DecodeCache cache;
    m->prefill(inputs(*m), par, cache);
    at::Tensor& g =
        m->parameters().at("lang_encoder.transformer.blocks.1.gated_cross_attn_layer.ff_gate");
    g = at::zeros(g.sizes(), at::kFloat);
    const std::string msg = error_of(
        [&] { m->decode_step(at::tensor(std::vector<int64_t>{3}, at::kLong), par, cache); });
    EXPECT_TRUE(names_both_devices(msg)) << msg;
  }
  {  // frames left on the host (not moved to the device after preprocessing)
    auto m = mplug_on_meta("241101");
    ModelInputs in = inputs(*m);
    in.pixel_values = at::zeros({2, 3, 32, 32}, at::kFloat);
    const std::string msg = error_of([&] { m->forward(in, par); });
    EXPECT_TRUE(names_both_devices(msg)) << msg;
  }
  {  // a media mask made on the host reaching lvx's kernel (its meta entry checks like CUDA's)
    const auto meta = at::TensorOptions().dtype(at::kFloat).device(kMeta);
    const at::Tensor q = at::empty({1, 4, 2, 8}, meta), k = at::empty({1, 6, 2, 8}, meta);
    kernels::AttentionParams p;
    p.mask.kind = kernels::MaskKind::kMedia;
    p.mask.q_media = at::zeros({1, 4}, at::kInt);
    p.mask.kv_media = at::zeros({1, 6}, at::kInt).to(kMeta);
    const std::string msg = error_of([&] { kernels::attention_forward(q, k, k, p); });
    EXPECT_NE(msg.find("q_media must be on meta"), std::string::npos) << msg;
    p.mask.q_media = p.mask.q_media.to(kMeta);
    EXPECT_TRUE(kernels::attention_forward(q, k, k, p).o.is_meta());
  }
}

// Llama-3.2-Vision: transformers' tiny checkpoint (tests/reference/mllama_ref.py, the one
// test_models_mllama.cpp makes) loaded straight onto meta; frames as one-tile images.
TEST(Placement, MllamaRunsForwardBackwardPrefillDecodeOnMeta) {
  const std::string script = lvx::testing::source_dir() + "/tests/reference/mllama_ref.py";
  const lvx::testing::Reference ref = lvx::testing::reference_model(
      "mllama", script, lvx::testing::script_stamp(script), "", "--length 24");
  for (const bool remat : {false, true}) {
    SCOPED_TRACE(remat ? "remat+recompute" : "plain");
    auto m = load_model(ref.model, at::kFloat, kMeta);
    run_everything_on_meta(*m, single_rank(remat, remat), 16);
  }
}

}  // namespace
}  // namespace lvx::models
