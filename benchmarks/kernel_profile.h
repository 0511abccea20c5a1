// Where a call's time goes, for bench_kernels --profile: each function runs under PyTorch's
// Kineto profiler (host operators and, on CUDA, the device kernels through CUPTI), its trace is
// saved as Chrome-trace JSON (opens in Perfetto or chrome://tracing), and one line per function
// says per call: wall time, host time to launch everything, the sum of device-kernel time, and
// the kernels that ran with their share. wall ≫ kernels means the device waits on the host
// (planning, allocation, dispatch); extra kernel names mean work the baseline does not do.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace lvx::bench {

struct ProfiledCall {
  std::string name;           // e.g. "lvx" or "flash"
  std::function<void()> run;  // one call
};

// Runs each call `warmup` times, then `iters` times under the profiler; writes
// DIR/<tag>-<name>.json and prints the summary lines to stdout.
void profile_calls(const std::string& dir, const std::string& tag,
                   const std::vector<ProfiledCall>& calls, const at::Device& device, int warmup,
                   int iters);

// lvx's local attention forward and backward next to the baseline bench_kernels times on the
// device (CUDA: ATen's flash forward and backward on [B, H, S, D]-contiguous tensors, K/V
// repeated to H heads; CPU: at::scaled_dot_product_attention), no mask, one batch row.
void profile_attention(const std::string& dir, const at::Device& device, at::ScalarType dtype,
                       int64_t sq, int64_t skv, int64_t heads, int64_t hkv, int64_t dim, int warmup,
                       int iters);

}  // namespace lvx::bench
