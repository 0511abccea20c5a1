// A model family: everything the runtime asks of one kind of checkpoint, answered in the
// family's own folder under models/ (models/mplug_owl3/, models/openflamingo/, models/mllama/)
// and registered by one line in models/families.cpp. src/runtime, src/attention and src/planner
// name no family: they ask the Family of a checkpoint (config.json's model_type) or the Model it
// loaded. A third family is one folder plus its registration line (docs/models.md, "Adding a
// family").
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "models/checkpoint.h"
#include "src/attention/media_mask.h"
#include "src/common/model_config.h"

namespace lvx::models {

class Model;
class Tokenizer;
struct Checkpoint;

// The token ids of one prompt and its labels. Labels follow lvx forward's convention (not
// shifted: position t's logits predict labels[t]): labels[t] = ids[t + 1] where ids[t + 1] is a
// token of the answer or the end of the turn, −100 everywhere else (the loss is on the answer).
struct PromptTokens {
  std::vector<int64_t> ids;
  std::vector<int64_t> labels;  // same length as ids
};

// The attentions of one decoder layer as they run: a self-attention over the text, a
// cross-attention to the visual tokens, or both, and which comes first. The planner's layers
// (Model::planner_model().layers) list the same attentions in the same order, decoder layer by
// decoder layer; the runtime maps its per-layer strategy choices through this.
// A media mask rule under the name people know a released model's behaviour by
// ("openflamingo", "mplug-owl3-240728"): what lvx's tools and tests accept besides the rules'
// names by meaning (attention::media_mask_rule_name).
struct NamedMediaMaskRule {
  std::string name;
  attention::MediaMaskRule rule;
};

struct DecoderLayerAttention {
  bool self = true;          // a causal self-attention over the text
  bool cross = false;        // a cross-attention to the visual tokens
  bool cross_first = false;  // with both: the cross-attention runs before the self-attention
};

// What a released checkpoint of a family holds, for writing release-shaped random checkpoints
// (lvx init-model, models/release_init.h): every tensor of the release's files by name and shape
// (the parameters lvx runs, plus what the release ships that lvx never computes: SigLIP's last
// layer and pooling head; a tied head is not written, as the releases do not), and the special
// tokens its template needs, each at the id config.json fixes for it (image_token_index,
// media_token_id, ...) or −1: the next free id after the tokenizer's words.
struct SpecialToken {
  std::string content;
  int64_t id = -1;
};
struct ReleaseLayout {
  ShapeSpec tensors;
  std::vector<SpecialToken> specials;
  int64_t embedding_rows = 0;  // token ids must stay below this (the input embedding's rows)
};
// A smaller model of a release's widths (0 keeps a size): fewer decoder layers (the first ones,
// with the cross layers among them as released, or at `cross_layers`: 0-based indices below
// `layers`), fewer vision layers (Llama-3.2-Vision: local and global alike), a smaller vocabulary.
struct ReleaseResize {
  int64_t layers = 0, vision_layers = 0, vocab = 0;
  std::vector<int64_t> cross_layers;
};

class Family {
 public:
  virtual ~Family() = default;

  // config.json's model_type ("mplugowl3", "openflamingo", "mllama"), the registry's key.
  virtual std::string model_type() const = 0;
  // The family's name for people ("mPLUG-Owl3"), in messages and reports.
  virtual std::string display_name() const = 0;

  // The model of checkpoint `ck` (every tensor's name, shape and dtype checked; errors name the
  // file and the field), its weights in `dtype` on `device`. On `meta`, shapes only: load_model
  // then reads each parameter straight to the device.
  virtual std::unique_ptr<Model> load(const Checkpoint& ck, at::ScalarType dtype,
                                      at::Device device) const = 0;
  // The planner's description of a checkpoint from its config.json alone (no weights read).
  virtual ModelConfig planner_model(const nlohmann::json& config,
                                    const std::string& where) const = 0;
  // Every parameter's shape from config.json alone: what load() checks a checkpoint against
  // (sizing a model before its weights are downloaded: load_model_shapes).
  virtual ShapeSpec parameter_shapes(const nlohmann::json& config,
                                     const std::string& where) const = 0;

  // The release's files for `config` (ReleaseLayout above) and `config` resized (ReleaseResize;
  // errors name `where`, the field and why, e.g. a layer count that keeps no cross layer).
  virtual ReleaseLayout release_layout(const nlohmann::json& config,
                                       const std::string& where) const = 0;
  virtual nlohmann::json resize_release(const nlohmann::json& config, const ReleaseResize& r,
                                        const std::string& where) const = 0;

  // The chat/prompt template: the ids of a question about `frames` video frames (one image per
  // frame, in order), and with `answer` the labelled answer and end of turn (fine-tuning).
  // Text (question, answer) never yields a special token; the template's own special tokens go
  // in as ids. Errors name the special token the tokenizer lacks.
  virtual PromptTokens prompt(const Tokenizer& tok, const std::string& question, int64_t frames,
                              const std::string* answer = nullptr) const = 0;
  // A conversation of (question, answer) turns about `frames` frames, every answer labelled
  // (fine-tuning rows in ms-swift's or LLaVA's shape): `system` (empty: none) placed as
  // prompt_chat places it, the frames with the first question, as in prompt(). The default takes
  // one turn (prompt()) and no system message and refuses more, naming the family; a template
  // that continues a conversation or has a system message overrides it.
  virtual PromptTokens prompt_turns(const Tokenizer& tok, const std::string& system,
                                    const std::vector<std::pair<std::string, std::string>>& turns,
                                    int64_t frames) const;
  // A conversation's prompt for generation (lvx serve): `system` (empty: none), the earlier
  // (question, answer) turns as the template's own turns (as prompt_turns writes them), then
  // `question` left open: the prompt ends where its answer begins, exactly where prompt(tok,
  // question, frames) ends, so no system message and no earlier turns give prompt()'s ids. The
  // frames go with the first question. Nothing is labelled. The default takes no earlier turns
  // and no system message and refuses either, naming the family; a template with no place for a
  // system message refuses one the same way.
  virtual PromptTokens prompt_chat(const Tokenizer& tok, const std::string& system,
                                   const std::vector<std::pair<std::string, std::string>>& earlier,
                                   const std::string& question, int64_t frames) const;
  // The ids of `frames` frames as the template places them, without the text around them (the
  // media of a prompt written by the user: lvx serve's /v1/completions): mPLUG-Owl3 one
  // <|image|> per frame (bracketed by <|start_video_frame|> … <|end_video_frame|> when the
  // tokenizer has them), Llama-3.2-Vision one <|image|> per frame, OpenFlamingo <image> per
  // frame with <|endofchunk|> between.
  virtual std::vector<int64_t> media_ids(const Tokenizer& tok, int64_t frames) const = 0;
  // Every token that stops generation (the end of the assistant's turn first, then end of text).
  virtual std::vector<int64_t> stop_tokens(const Tokenizer& tok) const = 0;
  // The image preprocessing preset of the family's vision tower (a video::PreprocessConfig
  // preset name: "siglip" squashes, "clip" resizes the short side and crops the centre).
  virtual std::string preprocess_preset() const = 0;
  // freeze.policy cross_only, the family's own recipe: whether parameter `name` trains.
  virtual bool trains_cross_only(const std::string& name) const = 0;
  // The media mask rules of the family's releases by name, canonical names first, then aliases
  // (none by default: its rules are still reachable by meaning).
  virtual std::vector<NamedMediaMaskRule> media_mask_rules() const { return {}; }

 protected:
  // The refusal of a template with no place for a system message: a non-empty `system` is an
  // error naming the family (prompt_turns and prompt_chat refuse it alike).
  void refuse_system(const std::string& system) const;
};

// The registered families (models/families.cpp), in registration order.
const std::vector<const Family*>& families();
// The family of `model_type`; an unknown type is an error naming `where` and listing every
// supported model_type.
const Family& family_of(const std::string& model_type, const std::string& where);
// The family of a checkpoint's config.json (its model_type field).
const Family& family_of_config(const nlohmann::json& config, const std::string& where);
// "mplugowl3, openflamingo, ...": the supported model types, for messages.
std::string supported_model_types();

// Every family's named media mask rules (Family::media_mask_rules), in registration order.
std::vector<NamedMediaMaskRule> named_media_mask_rules();
// A rule by a family's name for it or by its meaning (attention::media_mask_rule_name); an
// unknown name is an error listing every valid one.
attention::MediaMaskRule media_mask_rule(const std::string& name);

}  // namespace lvx::models
