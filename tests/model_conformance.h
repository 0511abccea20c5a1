// Shared pieces of the model conformance tests: a per-process work directory, the lvx binary
// and Python paths, and the comparison of `lvx forward` outputs with a reference's.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iostream>
#include <string>

#include <gtest/gtest.h>

#include "src/common/safetensors.h"
#include "tests/multirank.h"

namespace lvx::testing {

namespace fs = std::filesystem;

inline std::string lvx_binary() { return std::string(LVX_BINARY_DIR) + "/lvx"; }
inline std::string python() { return LVX_PYTHON; }

inline fs::path workdir() {
  static const fs::path dir = [] {
    fs::path d = fs::temp_directory_path() / ("lvx_test_models_" + std::to_string(::getpid()));
    fs::create_directories(d);
    return d;
  }();
  return dir;
}

struct Diff {
  double logits = 0, loss = 0, grad = 0;
  std::string worst_grad;
  size_t grads = 0;
};

inline Diff compare(const std::string& got_path, const std::string& want_path) {
  auto got = lvx::load_safetensors(got_path).tensors, want = lvx::load_safetensors(want_path).tensors;
  Diff d;
  d.logits = (got.at("logits") - want.at("logits")).abs().max().item<double>();
  if (got.count("loss")) d.loss = std::abs(got.at("loss").item<double>() - want.at("loss").item<double>());
  for (const auto& [name, g] : got) {
    if (name.rfind("grad.", 0) != 0) continue;
    EXPECT_TRUE(want.count(name)) << name << " has no reference gradient";
    if (!want.count(name)) continue;
    const at::Tensor& w = want.at(name);
    const double e = (g - w).abs().max().item<double>() / std::max(1e-6, w.abs().max().item<double>());
    if (e > d.grad) d.grad = e, d.worst_grad = name;
    ++d.grads;
  }
  return d;
}

// Asserts a conformance run: logits and loss within `atol`, every gradient within `rtol` of its
// largest element, and at least `min_grads` gradients compared.
inline void expect_conforms(const Diff& d, double atol, double rtol, size_t min_grads) {
  EXPECT_LE(d.logits, atol);
  EXPECT_LE(d.loss, atol);
  EXPECT_LE(d.grad, rtol) << d.worst_grad;
  EXPECT_GE(d.grads, min_grads);
}

}  // namespace lvx::testing
