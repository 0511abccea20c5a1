// kernels::linear (kernels/linear.h): the streamed weights of a decode step's product against a
// float64 product of the same (rounded) operands, at every row count it takes, row lengths with
// and without a tail, with a bias and with leading dims; the same bits on one thread and two;
// and what it leaves to ATen (gradients, strided weights, many rows, mixed dtypes).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>

#include "kernels/linear.h"

namespace lvx::kernels {
namespace {

// The float64 product of the operands as given (bf16 values widened exactly).
at::Tensor exact(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  at::Tensor y = at::matmul(x.to(at::kDouble), w.to(at::kDouble).t());
  return b.defined() ? y + b.to(at::kDouble) : y;
}

// |y − exact| bounded by the dtype's accumulation and output rounding: fp32 sums of K products
// (K·2⁻²⁴ relative to Σ|x·w|, taken as 4·K·ε here for the two-accumulator order) and, for bf16,
// the output's one rounding (2⁻⁸ of |y|).
void expect_close(const at::Tensor& y, const at::Tensor& x, const at::Tensor& w,
                  const at::Tensor& b) {
  const at::Tensor want = exact(x, w, b);
  const at::Tensor mag = at::matmul(x.to(at::kDouble).abs(), w.to(at::kDouble).abs().t()) +
                         (b.defined() ? b.to(at::kDouble).abs() : at::zeros({}, at::kDouble));
  const double K = static_cast<double>(w.size(1));
  at::Tensor tol = mag * (4 * K * std::ldexp(1.0, -24)) + 1e-30;
  if (y.scalar_type() == at::kBFloat16) tol = tol + want.abs() * std::ldexp(1.0, -8);
  const at::Tensor err = (y.to(at::kDouble) - want).abs();
  EXPECT_TRUE((err <= tol).all().item<bool>())
      << "worst error " << (err - tol).max().item<double>() << " above its bound, dtype "
      << y.scalar_type() << ", x " << x.sizes() << ", w " << w.sizes();
}

bool cpu_streams(at::ScalarType t) {
  return streams_weights(at::ones({1, 32}, at::TensorOptions().dtype(t)),
                         at::ones({4, 32}, at::TensorOptions().dtype(t)));
}

TEST(Linear, StreamedEqualsTheExactProductAtEveryRowCountAndLength) {
  for (const at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    if (!cpu_streams(t)) {
      std::cout << "this CPU does not stream " << t << " (AVX-512F / AVX512-BF16)\n";
      continue;
    }
    at::manual_seed(7);
    for (int64_t M = 1; M <= kStreamedRows; ++M)
      for (const int64_t K : {16, 17, 64, 100, 896, 1000})
        for (const int64_t N : {1, 5, 33}) {
          const at::Tensor x = at::randn({M, K}).to(t), w = at::randn({N, K}).to(t);
          const at::Tensor b = M % 2 ? at::randn({N}).to(t) : at::Tensor();
          ASSERT_TRUE(streams_weights(x, w));
          const at::Tensor y = streamed_linear(x, w, b.defined() ? c10::optional<at::Tensor>(b)
                                                                 : c10::nullopt);
          ASSERT_EQ(y.scalar_type(), t);
          ASSERT_EQ(y.sizes(), at::IntArrayRef({M, N}));
          expect_close(y, x, w, b);
        }
  }
}

TEST(Linear, LeadingDimsAndThreadsGiveTheSameBits) {
  for (const at::ScalarType t : {at::kFloat, at::kBFloat16}) {
    if (!cpu_streams(t)) continue;
    at::manual_seed(3);
    const at::Tensor x = at::randn({2, 1, 3, 300}).to(t), w = at::randn({1001, 300}).to(t);
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    const at::Tensor one = kernels::linear(x, w);
    at::set_num_threads(2);
    const at::Tensor two = kernels::linear(x, w);
    at::set_num_threads(threads);
    EXPECT_EQ(one.sizes(), at::IntArrayRef({2, 1, 3, 1001}));
    EXPECT_TRUE(at::equal(one, two));
    expect_close(one.view({6, 1001}), x.view({6, 300}), w, at::Tensor());
  }
}

TEST(Linear, LeavesToATenWhatItDoesNotStream) {
  const at::Tensor x = at::randn({1, 64}), w = at::randn({8, 64});
  EXPECT_FALSE(streams_weights(at::randn({kStreamedRows + 1, 64}), w));  // a GEMM's rows
  EXPECT_FALSE(streams_weights(x, at::randn({64, 8}).t()));              // strided weights
  EXPECT_FALSE(streams_weights(x.to(at::kBFloat16), w));                 // mixed dtypes
  EXPECT_FALSE(streams_weights(x.to(at::kDouble), w.to(at::kDouble)));
  EXPECT_FALSE(streams_weights(x.to(at::kMeta), w.to(at::kMeta)));
  const at::Tensor wg = w.clone().requires_grad_(true);
  EXPECT_FALSE(streams_weights(x, wg));  // a gradient is wanted: ATen's op, with its backward
  {
    c10::NoGradGuard no_grad;
    EXPECT_EQ(streams_weights(x, wg), cpu_streams(at::kFloat));
  }
  // What it leaves to ATen is ATen's product exactly.
  const at::Tensor big = at::randn({kStreamedRows + 1, 64});
  EXPECT_TRUE(at::equal(kernels::linear(big, w), at::linear(big, w)));
  // A gradient still flows through kernels::linear() where it does not stream.
  const at::Tensor y = kernels::linear(x, wg);
  y.sum().backward();
  EXPECT_TRUE(at::allclose(wg.grad(), x.expand({8, 64})));
}

}  // namespace
}  // namespace lvx::kernels
