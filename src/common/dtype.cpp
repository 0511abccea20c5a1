// The compute dtypes by name; see dtype.h.
#include "src/common/dtype.h"

#include "src/common/error.h"

namespace lvx {

at::ScalarType dtype_of(const std::string& name, const std::string& what) {
  if (name == "fp32") return at::kFloat;
  if (name == "bf16") return at::kBFloat16;
  if (name == "fp16") return at::kHalf;
  LVX_FAIL(what, ": expected fp32, bf16 or fp16, got '", name, "'");
}

std::string dtype_name(at::ScalarType t) {
  if (t == at::kFloat) return "fp32";
  if (t == at::kBFloat16) return "bf16";
  if (t == at::kHalf) return "fp16";
  LVX_FAIL("dtype ", t, " has no lvx name (fp32, bf16 or fp16)");
}

}  // namespace lvx
