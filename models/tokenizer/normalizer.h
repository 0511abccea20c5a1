// tokenizer.json's normalizer: Unicode normalization (NFC, NFD, NFKC, NFKD through ICU), none, or
// a Sequence of these. Internal to models/tokenizer/.
#pragma once

#include <unicode/uversion.h>

#include <string>
#include <vector>

#include "models/tokenizer/json_node.h"

U_NAMESPACE_BEGIN
class Normalizer2;
U_NAMESPACE_END

namespace lvx::models::tokenization {

struct Normalizer {
  std::vector<const icu::Normalizer2*> steps;  // applied in order; none: the identity

  // s normalized by every step (s must be valid UTF-8).
  std::string apply(std::string s) const;
};

// Appends the steps of tokenizer.json's "normalizer" (null: none). Errors name the JSON path.
void parse_normalizer(const Node& n, Normalizer* out);

}  // namespace lvx::models::tokenization
