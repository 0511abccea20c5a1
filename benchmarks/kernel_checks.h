// bench_kernels' correctness phase: every mask x dtype x head layout of the local attention
// kernels against the fp64 dense reference with the dual-reference gate of
// tests/test_kernels.cpp (o, lse, dq, dk, dv), and a merge of split K/V blocks, on any device.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace lvx::bench {

// The masks of the checks; the timing runs all but kPadding.
enum class MaskCase { kNone, kCausal, kMediaImmediate, kMediaUpTo, kPadding };

// The mask's name in --masks and in the log lines.
const char* mask_name(MaskCase m);

// lvx's dtype names (src/common/dtype.h), plus fp64 for the CPU reference precision.
std::string dtype_name(at::ScalarType t);

// Runs every check on `dev` (each comparison printed when `verbose`, failures always) and a
// summary line to stderr; returns the number of failures.
int run_checks(const at::Device& dev, bool verbose);

}  // namespace lvx::bench
