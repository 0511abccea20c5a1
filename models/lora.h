// LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models"; rsLoRA: Kalajdzievski,
// "A Rank Stabilization Scaling Factor for Fine-Tuning with LoRA") for every family, as one
// transform of the model's weights: an adapted linear weight W [out, in] is read as
//   W_eff = W + s · B · A,   A [r, in], B [out, r],   s = alpha / r (rsLoRA: alpha / sqrt(r)),
// which is what the layer computes, W·x + s·B·(A·x), for dropout 0. The model reads W_eff in
// place of W (by its checkpoint name), so no family needs LoRA code; training differentiates
// W_eff with respect to A and B.
//
// Files in PEFT's layout (peft 0.17, `PeftModel.save_pretrained`), so `PeftModel.from_pretrained`
// loads an lvx adapter onto the PyTorch model whose module paths are the checkpoint's names (the
// released model, e.g. transformers' mPLUG-Owl3 with its `language_model.` prefix), and lvx loads
// an adapter PEFT (or ms-swift, which saves through PEFT) wrote:
//   adapter_config.json        peft_type "LORA", r, lora_alpha, lora_dropout, target_modules,
//                              use_rslora, bias "none", base_model_name_or_path, task_type, ...
//   adapter_model.safetensors  base_model.model.<module path>.lora_A.weight [r, in] and
//                              base_model.model.<module path>.lora_B.weight [out, r], fp32
// where <module path> is the weight's checkpoint name without ".weight".
//
// Costs (docs/finetune.md): r·(in + out) parameters per adapted weight (fp32, with their
// gradients and AdamW's state); saved for the backward, r elements per token per adapted weight.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/model.h"

namespace lvx::models {

// ---- configuration -------------------------------------------------------------------------

struct LoraConfig {
  int64_t r = 8;       // rank
  double alpha = 8;    // lora_alpha (PEFT's default 8)
  double dropout = 0;  // lora_dropout: recorded (lvx finetune takes 0 only: train_config.h)
  bool use_rslora = false;
  // PEFT's semantics: a weight "<module>.weight" is adapted when <module> equals an entry or ends
  // with "." + entry ("q_proj" matches "...self_attn.q_proj"); {"all-linear"}: every linear
  // weight of the language model. Only what Model::trainable allows (never the vision tower),
  // never an embedding table; "all-linear" also leaves out the output head (lm_head, embed_out).
  std::vector<std::string> target_modules{"all-linear"};
  double scale(int64_t rank) const;  // alpha / r, or alpha / sqrt(r) with use_rslora
};

// The checkpoint names of the weights `cfg` adapts in `model`, sorted. An entry of
// target_modules that matches nothing, an embedding named explicitly, r < 1 or alpha <= 0 are
// errors naming `where` and the entry.
std::vector<std::string> lora_targets(Model& model, const LoraConfig& cfg,
                                      const std::string& where = "lora");

// ---- the adapter ---------------------------------------------------------------------------

struct LoraLayer {
  at::Tensor a;  // float32 [r, in] on the weight's device
  at::Tensor b;  // float32 [out, r]
  double scale = 1;
};

struct LoraAdapter {
  LoraConfig config;
  std::string base_model;                   // base_model_name_or_path
  std::map<std::string, LoraLayer> layers;  // by the adapted weight's checkpoint name
  int64_t parameters() const;               // Σ r·(in + out)
};

// A fresh adapter as PEFT initialises one (init_lora_weights=True): A ~ kaiming_uniform(a=√5),
// i.e. U(−1/√in, 1/√in), drawn from `seed` in name order; B = 0, so W_eff = W at step 0.
LoraAdapter init_lora(Model& model, const LoraConfig& cfg, uint64_t seed,
                      const std::string& base_model);

// Reads `dir` (adapter_config.json, adapter_model.safetensors) and matches every A/B pair to a
// weight of `model`: by its module path, or, when the adapter was saved from a model that names
// its modules without a prefix the checkpoint has (a PEFT model wrapping only the language
// model), by the one prefix under which every pair finds its weight. Refused, naming the file and
// field: another peft_type, DoRA, fan_in_fan_out, a bias, alpha_pattern, embedding or
// modules_to_save tensors, a pair whose shapes do not fit its weight, a key that matches no
// weight. r comes from each pair's shapes (rank_pattern is honoured).
LoraAdapter load_lora(const std::string& dir, Model& model);
// The same against a checkpoint's tensors by name (lvx merge-adapter, no model built).
LoraAdapter load_lora(const std::string& dir, const StateDict& weights);

// adapter_config.json as PEFT 0.17 writes it. target_modules: the configured list when, by
// PEFT's suffix rule over every linear weight of `model`, it selects exactly the adapted
// weights; otherwise a regular expression that PEFT full-matches against module paths and that
// selects exactly them (e.g. the vision tower's own q_proj left out).
nlohmann::json adapter_config_json(const LoraAdapter& adapter, Model& model);
// The tensors of adapter_model.safetensors (PEFT's key names, float32, on the host).
std::map<std::string, at::Tensor> adapter_tensors(const LoraAdapter& adapter);
// Writes both files into `dir` (created).
void save_lora(const std::string& dir, const LoraAdapter& adapter, Model& model);

// ---- applying it ---------------------------------------------------------------------------

// W + s·B·A in W's dtype (computed in float32); differentiable with respect to A and B.
at::Tensor lora_weight(const at::Tensor& w, const LoraLayer& l);

// Merges the adapter into the weights in place (no autograd): lvx qa --adapter, merge-adapter.
void merge_lora(StateDict& weights, const LoraAdapter& adapter);
// load_lora(dir, model) merged into model's weights (lvx qa --adapter).
void merge_adapter(Model& model, const std::string& dir);

// x·Wᵀ (+ b), plus s·(x·Aᵀ)·Bᵀ when `w` is a weight tensor that an alive LoraModel adapts (looked
// up by the tensor's storage identity; A and B read from that model's parameters() at the call,
// so an optimizer that replaces them is followed). models::linear's tensor form calls this.
at::Tensor lora_linear(const at::Tensor& x, const at::Tensor& w,
                       const c10::optional<at::Tensor>& bias);

// A model that trains an adapter: parameters() are the base model's weights (frozen) and, added
// to the same map, the adapter's A and B under "<module path>.lora_A.weight" / ".lora_B.weight"
// (float32), so a tensor replaced there (an optimizer's, a sharding engine's) is the one used;
// trainable() is true for those only. From construction to destruction, every linear over an
// adapted weight of the base model adds the LoRA branch (lora_linear): its forwards are the
// base model's own, and so are backward recomputations that run after a forward has returned.
class LoraModel : public Model {
 public:
  LoraModel(std::unique_ptr<Model> base, LoraAdapter adapter);
  ~LoraModel() override;
  LoraModel(const LoraModel&) = delete;
  LoraModel& operator=(const LoraModel&) = delete;

  // The adapter as made or loaded; the current A and B are parameters()'s (by lora_a_name).
  const LoraAdapter& adapter() const { return adapter_; }
  Model& base() { return *base_; }

  const Family& family() const override { return base_->family(); }
  StateDict& parameters() override { return base_->parameters(); }
  bool trainable(const std::string& name) const override;
  int64_t decoder_layers() const override { return base_->decoder_layers(); }
  int64_t decoder_layer_of(const std::string& name) const override {
    return base_->decoder_layer_of(name);
  }
  std::vector<DecoderLayerAttention> layer_attentions() const override {
    return base_->layer_attentions();
  }
  int64_t media_token_id() const override { return base_->media_token_id(); }
  int64_t tokens_per_media() const override { return base_->tokens_per_media(); }
  ModelConfig planner_model() const override { return base_->planner_model(); }
  ModelOutputs forward(const ModelInputs& in, const Parallel& par) const override;
  at::Tensor prefill(const ModelInputs& in, const Parallel& par, DecodeCache& cache) const override;
  at::Tensor decode_step(const at::Tensor& tokens, const Parallel& par,
                         DecodeCache& cache) const override;

 private:
  std::unique_ptr<Model> base_;
  LoraAdapter adapter_;
  // Points the activation path at the base model's current weight tensors (a sharding engine
  // may have replaced them since the last call): at construction and before each forward.
  void route() const;
  mutable std::vector<const c10::TensorImpl*> routed_;
};

// "<module path>.lora_A.weight" of an adapted weight's checkpoint name (LoraModel's names).
std::string lora_a_name(const std::string& weight);
std::string lora_b_name(const std::string& weight);

}  // namespace lvx::models
