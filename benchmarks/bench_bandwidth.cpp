// How fast this machine reads memory, for the decode bound of benchmarks/bench_real_size.py: the
// fastest of several ways to stream a large working set, each the best of --repeats, printed as
// one JSON line (bytes per second):
//   sum        ATen's sum over --gib GiB of fp32 (a reduction: one read stream per thread)
//   aten_mv    ATen's matrix-vector product over 4096 × 14336 fp32 matrices (--gib GiB of them)
//   stream_f32 kernels::linear (lvx's streamed decode product) over the same matrices
//   stream_bf16                                                   ... and their bf16 copies
//   stream_bf16_RxC  the same over bf16 matrices of Qwen2-7B's MLP shapes (18944 × 3584 and
//              3584 × 18944), whose read rate differs from the square-ish ones on some machines
// The machine's figure ("fastest") is the fastest of them: on a shared machine a single way can
// read a third below what the memory gives.
// First the streamed products are checked against ATen's on one matrix (they are the operands a
// decode step gives them); a mismatch stops the run.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>
#include <vector>

#include "kernels/linear.h"
#include "src/cli/args.h"

namespace {

template <typename F>
double best_seconds(int repeats, F&& f) {
  f();  // warm
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  lvx::cli::ArgParser p("bench_bandwidth [--gib G] [--repeats R] [--threads T]",
                        "This machine's memory read rate, several ways (JSON on stdout).");
  p.add_option("gib", 0, "2", "working set per measurement, GiB");
  p.add_option("repeats", 0, "3", "timed runs per measurement (the best is kept)");
  p.add_option("threads", 0, "0", "intra-op threads (0: every core)");
  if (!p.parse(argc, argv)) return 0;
  if (p.get_int("threads", 0, 4096) > 0) at::set_num_threads(static_cast<int>(p.get_int("threads")));
  const double gib = p.get_double("gib");
  const int repeats = static_cast<int>(p.get_int("repeats", 1, 100));
  const int64_t N = 14336, K = 4096;
  const int64_t mats = std::max<int64_t>(1, static_cast<int64_t>(gib * (1 << 30) / (N * K * 4)));
  std::vector<at::Tensor> f32, bf16;
  for (int64_t i = 0; i < mats; ++i) {
    f32.push_back(at::randn({N, K}));
    bf16.push_back(f32.back().to(at::kBFloat16));
  }
  const at::Tensor x = at::randn({1, K}), xb = x.to(at::kBFloat16);
  // Correctness first: the streamed products against ATen's.
  const double e32 = (lvx::kernels::linear(x, f32[0]) - at::linear(x, f32[0])).abs().max().item<double>();
  // bf16: against the fp32 product of the same bf16 values, within the output's rounding (2⁻⁸).
  const at::Tensor want16 = at::linear(xb.to(at::kFloat), bf16[0].to(at::kFloat));
  const double e16 = ((lvx::kernels::linear(xb, bf16[0]).to(at::kFloat) - want16).abs() /
                      (want16.abs() + 1)).max().item<double>();
  if (e32 > 1e-3 || e16 > 1.0 / 128) {
    std::cerr << "bench_bandwidth: the streamed product disagrees with ATen's (fp32 " << e32
              << ", bf16 " << e16 << ")\n";
    return 1;
  }
  const double bytes32 = static_cast<double>(mats * N * K * 4), bytes16 = bytes32 / 2;
  const at::Tensor big = at::randn({static_cast<int64_t>(gib * (1 << 30) / 4)});
  nlohmann::json out;
  out["threads"] = at::get_num_threads();
  out["streams_weights"] = lvx::kernels::streams_weights(x, f32[0]);
  out["sum"] = static_cast<double>(big.numel()) * 4 / best_seconds(repeats, [&] { big.sum(); });
  out["aten_mv"] = bytes32 / best_seconds(repeats, [&] {
    for (const auto& w : f32) at::mv(w, x[0]);
  });
  out["stream_f32"] = bytes32 / best_seconds(repeats, [&] {
    for (const auto& w : f32) lvx::kernels::linear(x, w);
  });
  out["stream_bf16"] = bytes16 / best_seconds(repeats, [&] {
    for (const auto& w : bf16) lvx::kernels::linear(xb, w);
  });
  for (const auto& [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{{18944, 3584}, {3584, 18944}}) {
    std::vector<at::Tensor> ws;
    const int64_t n = std::max<int64_t>(1, static_cast<int64_t>(gib * (1 << 30) / (rows * cols * 2)));
    for (int64_t i = 0; i < n; ++i) ws.push_back(at::randn({rows, cols}).to(at::kBFloat16));
    const at::Tensor v = at::randn({1, cols}).to(at::kBFloat16);
    out["stream_bf16_" + std::to_string(rows) + "x" + std::to_string(cols)] =
        static_cast<double>(n * rows * cols * 2) / best_seconds(repeats, [&] {
          for (const auto& w : ws) lvx::kernels::linear(v, w);
        });
  }
  double fastest = 0;
  for (const auto& [k, v] : out.items())
    if (k != "threads" && v.is_number_float()) fastest = std::max(fastest, v.get<double>());
  out["fastest"] = fastest;
  std::cout << out.dump() << "\n";
  return 0;
}
