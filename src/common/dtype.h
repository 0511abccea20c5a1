// The compute dtypes by the names lvx's flags and config files give them ("fp32", "bf16",
// "fp16"): one mapping for every reader (--dtype of lvx forward / qa / bench-plan, fine-tuning's
// model.dtype, the planner's workloads and model descriptions, the kernel benchmarks), so that a
// name one of them takes is never read differently, or silently replaced, by another.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

namespace lvx {

// "fp32" → float32, "bf16" → bfloat16, "fp16" → float16. Anything else is an lvx::Error
// "<what>: expected fp32, bf16 or fp16, got '<name>'"; `what` names the flag or the field
// ("--dtype", "run.yaml: model.dtype"). A caller that supports fewer dtypes refuses the others
// itself, by name.
at::ScalarType dtype_of(const std::string& name, const std::string& what);

// The inverse of dtype_of: "fp32", "bf16" or "fp16"; an lvx::Error for any other dtype.
std::string dtype_name(at::ScalarType t);

}  // namespace lvx
