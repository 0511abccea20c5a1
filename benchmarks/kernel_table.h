// bench_kernels' results table: one row per timed call (lvx's rate next to its baseline's), printed
// as a Markdown table or JSON lines, and the plausibility gate that refuses rates no device
// reaches (a timer that did not wait for the device).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lvx::bench {

struct Row {
  std::string device, dtype, op;
  int64_t sq, skv, heads, hkv, dim;
  double seconds, rate, baseline_rate;  // rate in GFLOP/s (CPU) or TFLOP/s (CUDA); the
                                        // ratio rate / baseline_rate is baseline time / lvx time
  std::string baseline;
  double spread;
};

// Prints `rows` to stdout: `format` "json" gives one JSON object a line, anything else a
// Markdown table.
void print_rows(const std::vector<Row>& rows, const std::string& format);

// Names the first row whose lvx or baseline rate exceeds its device's bound; empty when none.
std::string implausible_rate(const std::vector<Row>& rows);

}  // namespace lvx::bench
