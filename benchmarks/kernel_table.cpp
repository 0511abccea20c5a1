// bench_kernels' results table (benchmarks/kernel_table.h).
#include "benchmarks/kernel_table.h"

#include <algorithm>
#include <iostream>
#include <sstream>

namespace lvx::bench {
namespace {

// A rate no device reaches means the clock did not wait for the device (a timer that reads it
// after the launches alone): the table is refused rather than printed. The bounds are several
// times today's peaks (an H200's dense bf16 is ~1 PFLOP/s, a B200's ~2.3; a CPU's few TFLOP/s).
constexpr double kCudaTflopsBound = 5000, kCpuGflopsBound = 200000;

// One JSON object per row, one a line.
void print_json(const std::vector<Row>& rows) {
  for (const auto& r : rows) {
    std::cout << "{\"device\":\"" << r.device << "\",\"dtype\":\"" << r.dtype << "\",\"op\":\""
              << r.op << "\",\"sq\":" << r.sq << ",\"skv\":" << r.skv << ",\"heads\":" << r.heads
              << ",\"hkv\":" << r.hkv << ",\"dim\":" << r.dim
              << ",\"median_ms\":" << r.seconds * 1e3 << ",\"rate\":" << r.rate
              << ",\"baseline\":\"" << r.baseline << "\",\"baseline_rate\":" << r.baseline_rate
              << ",\"ratio\":" << (r.baseline_rate > 0 ? r.rate / r.baseline_rate : 0)
              << ",\"spread\":" << r.spread << "}\n";
  }
}

}  // namespace

void print_rows(const std::vector<Row>& rows, const std::string& format) {
  if (format == "json") {
    print_json(rows);
    return;
  }
  std::cout << "| device | dtype | op | Sq | Skv | H | Hkv | D | median ms | rate | baseline | "
               "baseline rate | ratio |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  for (const auto& r : rows) {
    const char* unit = r.device == "cpu" ? " GFLOP/s" : " TFLOP/s";
    std::cout << "| " << r.device << " | " << r.dtype << " | " << r.op << " | " << r.sq << " | "
              << r.skv << " | " << r.heads << " | " << r.hkv << " | " << r.dim << " | "
              << r.seconds * 1e3 << " | " << r.rate << unit << " | " << r.baseline << " | "
              << r.baseline_rate << unit << " | "
              << (r.baseline_rate > 0 ? r.rate / r.baseline_rate : 0) << " |\n";
  }
}

std::string implausible_rate(const std::vector<Row>& rows) {
  for (const auto& r : rows) {
    const double bound = r.device == "cpu" ? kCpuGflopsBound : kCudaTflopsBound;
    if (r.rate > bound || r.baseline_rate > bound) {
      std::ostringstream os;
      os << r.device << " " << r.dtype << " " << r.op << " " << r.sq << "x" << r.skv << ": "
         << std::max(r.rate, r.baseline_rate) << (r.device == "cpu" ? " GFLOP/s" : " TFLOP/s")
         << " exceeds " << bound << "; the timer did not wait for the device";
      return os.str();
    }
  }
  return "";
}

}  // namespace lvx::bench
