// x·Wᵀ (+ b): the product of every linear layer (models/layers.h, lora_linear, the LM heads).
//
// ATen's at::linear, except for the few rows of a decode step on a CPU, where lvx streams the
// weights itself. A decode step reads every weight once for one token a row: the product is a
// matrix-vector product bound by memory bandwidth, and ATen's CPU path for it (MKL's sgemv for
// fp32, oneDNN's bf16 GEMM at M = 1) reads the weights at 11–15 GB/s on a 2-core EPYC whose cores
// read 31–46 GB/s together: it stays on one thread for these shapes and does not stream. The loop
// here (linear_cpu.cpp) gives each thread a contiguous range of weight rows and reads each row
// once, front to back, for all the x rows at once: 27–46 GB/s on the same machine (fp32 and bf16,
// shapes of Qwen2-0.5B to Llama-3's 4096 × 14336; docs/real_size.md has the measurement).
//
// The streamed path takes: a CPU, x with at most kStreamedRows rows (its leading dims flattened),
// x and W both fp32 or both bf16, W contiguous [N, K], no gradient wanted, and a CPU with
// AVX-512F (bf16: AVX512-BF16, whose dot product multiplies the bf16 pairs exactly and adds in
// fp32, as oneDNN's bf16 GEMM does). It accumulates in fp32 and rounds once to x's dtype; the
// order of the sums differs from ATen's (results agree to fp32 rounding). Everything else, and
// everything with LVX_CPU_LINEAR=aten, is at::linear.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace lvx::kernels {

constexpr int64_t kStreamedRows = 8;

at::Tensor linear(const at::Tensor& x, const at::Tensor& w,
                  const c10::optional<at::Tensor>& bias = c10::nullopt);

// Whether linear() streams the weights for these operands (tests and benchmarks).
bool streams_weights(const at::Tensor& x, const at::Tensor& w);

// The streamed product itself (streams_weights must hold; the tests compare it with at::linear).
at::Tensor streamed_linear(const at::Tensor& x, const at::Tensor& w,
                           const c10::optional<at::Tensor>& bias);

}  // namespace lvx::kernels
