// Unicode normalizers through ICU; see normalizer.h.
#include "models/tokenizer/normalizer.h"

#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>

#include <utility>

#include "src/common/error.h"

namespace lvx::models::tokenization {

std::string Normalizer::apply(std::string s) const {
  for (const icu::Normalizer2* n : steps) {
    UErrorCode status = U_ZERO_ERROR;
    const icu::StringPiece in(s.data(), static_cast<int32_t>(s.size()));
    if (n->isNormalizedUTF8(in, status) && U_SUCCESS(status)) continue;
    status = U_ZERO_ERROR;
    std::string out;
    icu::StringByteSink<std::string> sink(&out, static_cast<int32_t>(s.size()));
    n->normalizeUTF8(0, in, sink, nullptr, status);
    LVX_CHECK(U_SUCCESS(status), "tokenizer: Unicode normalization failed: ", u_errorName(status));
    s = std::move(out);
  }
  return s;
}

void parse_normalizer(const Node& n, Normalizer* out) {
  if (n.is_null()) return;
  const std::string type = n.type();
  if (type == "Sequence") {
    n.only_fields({"type", "normalizers"});
    const Node list = n.required("normalizers");
    list.expect_array();
    for (size_t i = 0; i < list.size(); ++i) parse_normalizer(list.item(i), out);
    return;
  }
  n.only_fields({"type"});
  UErrorCode status = U_ZERO_ERROR;
  const icu::Normalizer2* norm = nullptr;
  if (type == "NFC") {
    norm = icu::Normalizer2::getNFCInstance(status);
  } else if (type == "NFD") {
    norm = icu::Normalizer2::getNFDInstance(status);
  } else if (type == "NFKC") {
    norm = icu::Normalizer2::getNFKCInstance(status);
  } else if (type == "NFKD") {
    norm = icu::Normalizer2::getNFKDInstance(status);
  } else {
    n.child("type").fail("unsupported normalizer \"" + type +
                         "\" (supported: NFC, NFD, NFKC, NFKD, Sequence)");
  }
  LVX_CHECK(U_SUCCESS(status) && norm, "tokenizer: ICU ", type,
            " normalizer unavailable: ", u_errorName(status));
  out->steps.push_back(norm);
}

}  // namespace lvx::models::tokenization
