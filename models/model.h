// A loaded model behind one interface (vLLM's per-family files over shared layers): a
// checkpoint directory's config.json model_type picks the family (models/family.h), whose folder
// under models/ implements this interface.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "models/checkpoint.h"
#include "models/decode.h"
#include "models/family.h"
#include "models/parallel.h"
#include "src/common/model_config.h"

namespace lvx::models {

// Inputs of one step, global (every rank has the whole prompt).
struct ModelInputs {
  at::Tensor input_ids;     // int64 [B, L], the family's media token where each image sits
  at::Tensor pixel_values;  // float [N_img, 3, H, W], preprocessed, images in prompt order
  // pixel_values holds only this rank's images (its slots of media_layout, models/parallel.h, in
  // prompt order): each rank decoded its own share of the frames (video::ShardSpec is the same
  // split).
  bool pixels_local = false;
  // Inputs a family's processor adds, by the names that processor gives them (Mllama:
  // aspect_ratio_ids, aspect_ratio_mask, cross_attention_mask); lvx forward passes every tensor
  // of its batch file but input_ids, pixel_values and labels here. Families that read none
  // refuse unknown names; absent ones are derived from input_ids where the family can.
  std::map<std::string, at::Tensor> named;
  // This rank's encoded media, in and out (encode_local_media in models/parallel.h): features
  // given are used instead of encoding pixel_values (lvx serve's visual cache); an empty one
  // receives what the prefill encoded. Null: encode, keep nothing.
  LocalMedia* media = nullptr;
};

struct ModelOutputs {
  at::Tensor logits;     // [B, L_r, V]: this rank's text shard (positions below)
  at::Tensor positions;  // int64 [L_r] on the host: global token index of each local row
};

class Model {
 public:
  virtual ~Model() = default;
  virtual const Family& family() const = 0;
  virtual StateDict& parameters() = 0;
  // What fine-tuning updates (every family: all but the frozen vision encoder).
  virtual bool trainable(const std::string& name) const = 0;
  // freeze.policy cross_only, the family's own recipe: whether parameter `name` trains. By
  // default the family's recipe by name (Family::trains_cross_only); a family whose recipe needs
  // the configuration (which decoder layers are cross layers) overrides it.
  virtual bool trains_cross_only(const std::string& name) const {
    return family().trains_cross_only(name);
  }
  virtual int64_t decoder_layers() const = 0;
  // The decoder layer parameter `name` belongs to (0-based), or -1 for the rest (embeddings, the
  // final norm, the head, the vision side): the units ZeRO stage 3 gathers layer by layer.
  virtual int64_t decoder_layer_of(const std::string& name) const {
    (void)name;
    return -1;
  }
  // Each decoder layer's attentions and their order (planner_model().layers lists the same).
  virtual std::vector<DecoderLayerAttention> layer_attentions() const = 0;
  virtual int64_t media_token_id() const = 0;
  virtual int64_t tokens_per_media() const = 0;  // keys per image in the cross-attention
  // The attention layers as they run, for the planner.
  virtual ModelConfig planner_model() const = 0;
  virtual ModelOutputs forward(const ModelInputs& in, const Parallel& par) const = 0;

  // Generation (models/decode.h). prefill: the distributed forward of the prompt, leaving this
  // rank's K/V in `cache`; returns the last prompt token's logits [B, V] (fp32, identical on
  // every rank). decode_step: the next token of every sample (int64 [B], identical on every
  // rank) through the cache by pass-Q decoding; returns its logits [B, V]. No autograd. The
  // default throws: a family without generation says so.
  virtual at::Tensor prefill(const ModelInputs& in, const Parallel& par, DecodeCache& cache) const;
  virtual at::Tensor decode_step(const at::Tensor& tokens, const Parallel& par,
                                 DecodeCache& cache) const;
  // The cross-attention calls of one decode_step, in its order (lead decoding's other ranks
  // answer them: models/lead_decode.h). Empty: the family has none.
  virtual std::vector<CrossCall> decode_cross_calls() const { return {}; }
  // extend: several prompt tokens of every sample (int64 [B, T] on the host, the same on every
  // rank) after a prefill, in one pass through the layers against the cache, as decode_step
  // takes one (pass-Q for the cached keys, causal among the new ones); returns the last one's
  // logits [B, V] and leaves their K/V in the cache. What a kept prompt prefix needs
  // (src/runtime/generate.h). Families without it say can_extend() false.
  virtual bool can_extend() const { return false; }
  virtual at::Tensor extend(const at::Tensor& tokens, const Parallel& par,
                            DecodeCache& cache) const;
  // Chunked prefill (lvx serve's --max-batch-tokens): prefill_media encodes this rank's images
  // of the prompt in.input_ids [B, L] (or takes in.media's features) and leaves their visual
  // K/V in `cache` with no text (length 0, prompt_media set: models/decode.h); no collective, so
  // it may run on another thread than the ranks' lockstep. Then extend runs the prompt's tokens
  // in chunks, each token seeing the images before it by the family's media rule, and
  // seal_chunked_prompt ends it: the cache is then a whole prefill's up to rounding. Families
  // without it say can_prefill_in_chunks() false (their prompts run whole).
  virtual bool can_prefill_in_chunks() const { return false; }
  virtual void prefill_media(const ModelInputs& in, const Parallel& par, DecodeCache& cache) const;
  // decode_rows: one decode step of several independent generations at once (continuous
  // batching, lvx serve): row r's token tokens[r] (int64 [R] on the host, identical on every
  // rank) against caches[r], each from its own prefill of one sample at its own length; returns
  // logits [R, V] (fp32). Equal to decode_step on each cache alone up to the batched products'
  // rounding (bitwise for R = 1). The default runs decode_step row by row (correct, no speed-up);
  // families that batch the step say batches_rows() true.
  virtual bool batches_rows() const { return false; }
  // extend_rows: extend for several generations at once (lvx serve's step: the running rows'
  // next tokens, one each, beside the questions of the rows joining): row r's tokens tokens[r]
  // (int64 [T_r] on the host, identical on every rank) after its prefill, against caches[r]
  // (one sample each); returns every row's last token's logits [R, V]. The default runs the
  // one-token rows through decode_rows and extends the others row by row; a family that batches
  // both (mPLUG-Owl3) runs every row's tokens in one forward.
  virtual at::Tensor extend_rows(const std::vector<at::Tensor>& tokens, const Parallel& par,
                                 const std::vector<DecodeCache*>& caches) const;
  virtual at::Tensor decode_rows(const at::Tensor& tokens, const Parallel& par,
                                 const std::vector<DecodeCache*>& caches) const;
};

// Refuses every named input (ModelInputs::named) not in `known`, naming it and `model`'s inputs
// (a family that reads none passes an empty list).
void check_named_inputs(const ModelInputs& in, const std::vector<std::string>& known,
                        const std::string& model);

// The logits of the last token (global position length − 1) from the rank that holds it, on
// every rank: hidden [B, L_r, W] after the final norm, positions [L_r] on the host.
at::Tensor last_token_logits(const at::Tensor& hidden, const at::Tensor& positions, int64_t length,
                             const at::Tensor& head, dist::ProcessGroup& pg);

// Which parameters of `model` train under freeze policy `policy` (vision | cross_only | none):
// none trains everything, vision all but the frozen vision tower (Model::trainable), cross_only
// the family's own recipe (Model::trains_cross_only).
bool trains_under(const std::string& policy, const Model& model, const std::string& name);

// Loads the family of `dir` (config.json's model_type) with its tokenizer.json, its weights in
// `dtype` on `device` (src/runtime/device.h picks it); errors name the file and the field, or
// list the supported model types.
//
// Where tensors live (every family; tests/test_models_placement.cpp checks it on `meta`):
// weights, activations, visual features and K/V on the weights' device; input_ids and the media
// layout computed from them (the plan of the step: which rank encodes which image) may stay on
// the host and are moved where they meet activations; pixel_values on the weights' device
// (moved once by the job after preprocessing). Every tensor a model creates takes its options
// from the tensor it relates to.
//
// `defer` (optional) leaves the parameters it selects on the `meta` device, unread: ZeRO stage 3
// reads them one tensor at a time into its shards (src/runtime/layer_sharding.h), so no rank
// ever holds them whole. Such a load reads tensors one at a time on the CPU too. `index`
// (optional) receives the checkpoint's index the load used (read_tensor reads the deferred
// ones from it; the manifest is not verified twice).
using DeferParameter = std::function<bool(const Model& model, const std::string& name)>;
std::unique_ptr<Model> load_model(const std::string& dir, at::ScalarType dtype,
                                  at::Device device = at::kCPU, const DeferParameter& defer = {},
                                  std::shared_ptr<const CheckpointIndex>* index = nullptr);
// The model of `dir` built on `meta` from its config.json alone (Family::parameter_shapes; no
// weight file, index or tokenizer needed): parameter names, shapes, trainability and layers, for
// sizing a model before downloading it (lvx plan --model DIR).
std::unique_ptr<Model> load_model_shapes(const std::string& dir);
// The same from a config.json already read (`where` names it in errors; `dir` is where a
// tokenizer.json would be, if any).
std::unique_ptr<Model> model_from_config(const nlohmann::json& config, const std::string& where,
                                         const std::string& dir);
// `name` within the model's layer-numbered parameters: the integer right after `prefix` and
// before the next '.', or -1 when `name` does not start with prefix + digits + '.'.
int64_t layer_number_after(const std::string& name, const std::string& prefix);

// The planner's description of a checkpoint from its config.json alone (no weights read).
ModelConfig planner_model_from_config(const nlohmann::json& config,
                                               const std::string& where);

}  // namespace lvx::models
