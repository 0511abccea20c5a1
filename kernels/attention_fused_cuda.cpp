// The CUDA table of the fused path (kernels/attention_fused.h): ATen's flash attention for
// bf16/fp16 calls without a mask, ATen's memory-efficient attention (xFormers' CUTLASS kernels,
// Rabe & Staats 2021 "Self-attention Does Not Need O(n²) Memory") for fp32, masked and non-square
// causal calls; both return the natural-log lse in fp32. Only dispatcher ops: compiled in every
// build, so the choice of kernel and the constraints are unit-tested on CPU; called only for
// CUDA tensors (attention_{fwd,bwd}.cu). Passed its gate, tests/gpu/run.sh, on an H200
// (docs/kernels.md).
//
// Where ATen states what these ops take (PyTorch 2.11 source, aten/src/ATen/native/transformers/):
//   sdp_utils.cpp (cuda/)      which GPUs, dtypes and head dims each backend serves;
//   cuda/attention.cu          _efficient_attention_forward: lse padded along the queries to a
//                              multiple of kAlignLSE = 32; attn_bias [B, H, M, N] in q's dtype
//                              with a contiguous last dim;
//   cuda/attention_backward.cu the backward reads lse through its strides and delta from
//                              rowsum(dO ∘ out), which the O' trick relies on;
//   cuda/mem_eff_attention/kernel_{forward,backward}.h  check_supported(): pointer and stride
//                              alignment, lse strides (multiples of 8) and padding (+inf);
//                              Params: the backward's `out` row stride is computed (H·D), not
//                              read from the tensor.
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <tuple>

#include "kernels/attention_fused.h"
#include "src/common/error.h"

namespace lvx::kernels {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kBiasAlign = 16;  // see cuda_fused_ops
constexpr int64_t kLseAlign = 32;   // kAlignLSE of cuda/mem_eff_attention/kernel_forward.h

bool is_half(at::ScalarType t) { return t == at::kBFloat16 || t == at::kHalf; }

// The bias as the memory-efficient op takes it: one [n, m] mask broadcast over the H heads of
// the call (head stride 0; its B/H/M strides then all satisfy check_supported's alignment).
at::Tensor bias_for(const FusedCall& c) {
  return c.bias.expand({1, c.q.size(1), c.q.size(2), c.k.size(2)});
}

// Seed and offset of dropout: ATen makes them host tensors when no CUDA graph is being captured
// and reads them only when dropout_p > 0 (cuda/attention.cu, attention_backward.cu); lvx uses no
// dropout.
at::Tensor no_seed(const FusedCall& c) {
  return at::empty({}, c.q.options().dtype(at::kLong).device(at::kCPU));
}

FusedKernel kernel_for(const FusedOps& ops, const FusedCall& c) {
  return cuda_fused_kernel(c.q.scalar_type(), c.causal, c.bias.defined(), c.q.size(2), c.k.size(2),
                           c.q.size(3), ops.sm);
}

std::tuple<at::Tensor, at::Tensor> cuda_forward(const FusedOps& ops, const FusedCall& c) {
  const int64_t n = c.q.size(2);
  if (kernel_for(ops, c) == FusedKernel::kFlash) {
    // lse [1, H, n] fp32 (torch/_meta_registrations.py, meta__scaled_dot_product_flash_attention).
    auto r = at::_scaled_dot_product_flash_attention(c.q, c.k, c.v, 0.0, c.causal,
                                                     /*return_debug_mask=*/false, c.scale);
    return {std::get<0>(r), std::get<1>(r).narrow(2, 0, n)};
  }
  // lse [1, H, ceil(n / 32) * 32] fp32, the padding +inf (meta__scaled_dot_product_efficient_
  // attention; kernel_forward.h). is_causal here is top-left (CausalFromTopLeft).
  auto [o, lse, seed, offset] = at::_scaled_dot_product_efficient_attention(
      c.q, c.k, c.v, c.bias.defined() ? std::optional<at::Tensor>(bias_for(c)) : std::nullopt,
      /*compute_log_sumexp=*/true, 0.0, c.causal, c.scale);
  // A row whose bias is −inf everywhere has s' = 0: whatever the kernel wrote there, lvx's
  // convention is o = 0 (the plan sets its lse to −inf).
  if (c.rows.defined()) o = o.masked_fill(c.rows.logical_not().unsqueeze(-1), 0);
  return {o, lse.narrow(2, 0, n)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_backward(const FusedOps& ops,
                                                             const FusedCall& c,
                                                             const at::Tensor& dout,
                                                             const at::Tensor& out,
                                                             const at::Tensor& lse) {
  const int64_t n = c.q.size(2), m = c.k.size(2);
  const at::Tensor seed = no_seed(c);
  if (kernel_for(ops, c) == FusedKernel::kFlash) {
    // lse [1, H, n] contiguous, as the forward returned it.
    return at::_scaled_dot_product_flash_attention_backward(dout, c.q, c.k, c.v, out, lse,
                                                            at::Tensor(), at::Tensor(), n, m, 0.0,
                                                            c.causal, seed, seed, c.scale);
  }
  // The layout the forward returns: padded to a multiple of 32 queries with +inf, so that the
  // backward's strides are multiples of 8 and the rows past n it reads give P = 0.
  at::Tensor lse_pad =
      at::full({lse.size(0), lse.size(1), (n + kLseAlign - 1) / kLseAlign * kLseAlign}, kInf,
               lse.options().dtype(at::kFloat));
  lse_pad.narrow(2, 0, n).copy_(lse);
  // The kernel takes out's batch and head strides but computes its row stride as H·D
  // (kernel_backward.h, Params::o_strideM), so out must be [1, n, H, D]-contiguous; O' of one
  // query head per group is a strided view (row stride Hq·D): copy it.
  const at::Tensor out_rows = out.transpose(1, 2).contiguous().transpose(1, 2);
  auto [gq, gk, gv, gb] = at::_scaled_dot_product_efficient_attention_backward(
      dout, c.q, c.k, c.v, c.bias.defined() ? bias_for(c) : at::Tensor(), out_rows, lse_pad, seed,
      seed, 0.0, {true, true, true, false}, c.causal, c.scale);
  return {gq, gk, gv};
}

const std::string& cuda_attention_setting() {
  static const std::string s = [] {
    const char* e = std::getenv("LVX_CUDA_ATTENTION");
    std::string v = e != nullptr ? e : "";
    LVX_CHECK(v.empty() || v == "fused" || v == "gemm" || v == "kernel",
              "LVX_CUDA_ATTENTION must be fused (the default), gemm or kernel, got '", v, "'");
    return v;
  }();
  return s;
}

}  // namespace

const char* fused_kernel_name(FusedKernel k) {
  return k == FusedKernel::kFlash ? "flash" : "efficient";
}

FusedKernel cuda_fused_kernel(at::ScalarType dtype, bool causal, bool has_bias, int64_t n,
                              int64_t m, int64_t d, int sm) {
  // sdp_utils.cpp, check_flash_attention_hardware_support: flash is built for sm80-sm121.
  const bool flash_gpu = sm >= 80 && sm <= 121;
  // flash_api.cpp (mha_fwd/mha_bwd): head dim <= 256; sdp_utils.cpp,
  // check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120: the backward fails
  // above 192 on sm86-89 and sm120 (forward and backward take the same kernel here).
  const bool flash_dim = d <= 256 && !(d > 192 && ((sm >= 86 && sm <= 89) || sm >= 120));
  // Flash takes no attn_bias (the op has none) and fp16/bf16 only (check_tensor_dtype); its
  // is_causal is aligned to the bottom right, which is lvx's top-left only when n == m
  // (sdp_utils.cpp, check_flash_causal_non_square_seqlens).
  const bool flash = is_half(dtype) && flash_gpu && flash_dim && !has_bias && (!causal || n == m);
  return flash ? FusedKernel::kFlash : FusedKernel::kEfficient;
}

const char* cuda_fused_unsupported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   int sm) {
  // Every call can fall to the memory-efficient kernel (cuda_fused_kernel), so a block is taken
  // when that kernel takes all of it. The bias alignment (row stride a multiple of 16 elements,
  // kernel_backward.h check_supported "attn_bias is not correctly aligned (strideM)"; ATen's own
  // SDPA pads the mask the same way, attention.cpp preprocess_mask) holds by construction
  // (FusedOps::bias_align), and the lse layout is the backward wrapper's (cuda_backward).
  const auto t = q.scalar_type();
  // sdp_utils.cpp check_tensor_dtype: fp32, fp16, bf16.
  if (t != at::kFloat && !is_half(t)) return "dtype is not fp32, fp16 or bf16";
  // sdp_utils.cpp check_mem_efficient_hardware_support: sm50-sm121.
  if (sm < 50 || sm > 121) return "GPU outside sm50-sm121 (ATen's memory-efficient attention)";
  // mem_eff_attention/kernels/cutlassF.h, cutlassB.h: bf16 kernels exist for sm80+ only.
  if (t == at::kBFloat16 && sm < 80) return "bf16 needs sm80+ (ATen's memory-efficient kernels)";
  const int64_t d = q.size(3);
  // sdp_utils.cpp check_head_dim_size_mem_efficient: head dim a multiple of
  // minimum_gemm_alignment (at most 8: 128 bits of a 16-bit type on tensor cores), which also
  // keeps every row and head view below 16-byte aligned.
  if (d % 8 != 0) return "head dim is not a multiple of 8";
  // flash_api.cpp: head dim <= 256 for flash; lvx keeps the memory-efficient calls to the same
  // bound (beyond it attention_backward.cu skips kernels whose shared memory does not fit and
  // can end in "cutlassB: no kernel found to launch!").
  if (d > 256) return "head dim is above 256";
  // kernel_forward.h / kernel_backward.h check_supported: CHECK_ALIGNED_PTR(query_ptr,
  // kAlignmentQ) and the same for key/value: 128-bit accesses.
  for (const at::Tensor* x : {&q, &k, &v}) {
    if (reinterpret_cast<std::uintptr_t>(x->data_ptr()) % 16 != 0) {
      return "q, k or v does not start at a 16-byte aligned address";
    }
  }
  return nullptr;
}

CudaAttentionPath cuda_attention_path(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      int sm) {
  const std::string& s = cuda_attention_setting();
  if (s == "kernel" || q.scalar_type() == at::kDouble || q.size(1) == 0 || k.size(1) == 0) {
    return CudaAttentionPath::kKernel;
  }
  if (s == "gemm") return CudaAttentionPath::kGemm;
  return cuda_fused_unsupported(q, k, v, sm) == nullptr ? CudaAttentionPath::kFused
                                                        : CudaAttentionPath::kGemm;
}

bool cuda_takes_grouped_heads(const FusedOps& ops, const FusedCall& c) {
  return kernel_for(ops, c) == FusedKernel::kFlash;
}

FusedOps cuda_fused_ops(int sm, MergeFn merge) {
  // kBiasAlign: bias rows start at multiples of 16 elements (cuda_fused_unsupported).
  return {"cuda", cuda_forward, cuda_backward, merge, kBiasAlign, sm, cuda_takes_grouped_heads};
}

}  // namespace lvx::kernels
