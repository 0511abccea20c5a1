// tokenizer.json's post_processor: TemplateProcessing (its "single" template: special tokens around
// the sequence, applied with add_special_tokens), ByteLevel (offsets only: no ids change), or a
// Sequence of these. Internal to models/tokenizer/.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "models/tokenizer/json_node.h"

namespace lvx::models::tokenization {

struct PostProcessor {
  // TemplateProcessing's "single" template: nullopt for the sequence, else special token ids.
  std::vector<std::optional<std::vector<int64_t>>> single;
  // The ids with the template's special tokens placed around them.
  std::vector<int64_t> apply(const std::vector<int64_t>& ids) const;
};

// Appends the steps of tokenizer.json's "post_processor" (null: none; a Sequence flattened).
// `known(id)`: whether the id is a token of the tokenizer (the template's ids must be). "pair"
// is checked but unused (single sequences only). Errors name the JSON path.
void parse_post_processor(const Node& n, const std::function<bool(int64_t)>& known,
                          std::vector<PostProcessor>* out);

}  // namespace lvx::models::tokenization
