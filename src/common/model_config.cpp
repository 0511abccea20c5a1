#include "src/common/model_config.h"

#include "src/common/dtype.h"
#include "src/common/error.h"

namespace lvx {

const char* to_string(LayerKind kind) { return kind == LayerKind::kSelf ? "self" : "cross"; }

const char* to_string(MaskRule rule) {
  switch (rule) {
    case MaskRule::kNone:
      return "none";
    case MaskRule::kCausal:
      return "causal";
    case MaskRule::kMediaImmediate:
      return "media_immediate";
    case MaskRule::kMediaUpTo:
      return "media_upto";
  }
  return "?";
}

MaskRule mask_rule_from_string(const std::string& s, const std::string& where) {
  if (s == "none") return MaskRule::kNone;
  if (s == "causal") return MaskRule::kCausal;
  if (s == "media_immediate") return MaskRule::kMediaImmediate;
  if (s == "media_upto") return MaskRule::kMediaUpTo;
  LVX_FAIL(where, ": expected none|causal|media_immediate|media_upto, got '", s, "'");
}

int64_t dtype_bytes(const std::string& dtype, const std::string& where) {
  return static_cast<int64_t>(c10::elementSize(dtype_of(dtype, where)));
}

int64_t ModelConfig::count(LayerKind kind) const {
  int64_t n = 0;
  for (const auto& l : layers) n += l.kind == kind;
  return n;
}

}  // namespace lvx
