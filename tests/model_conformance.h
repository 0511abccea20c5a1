// Shared pieces of the model conformance tests: a per-process work directory, the lvx binary
// and Python paths, and the comparison of `lvx forward` outputs with a reference's.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <string>

#include "src/common/safetensors.h"
#include "tests/build_paths.h"
#include "tests/multirank.h"

namespace lvx::testing {

namespace fs = std::filesystem;

inline std::string lvx_binary() { return lvx::testing::binary_dir() + "/lvx"; }
// lvx with the fault-injection hooks (tests/support/fault_injection.cpp): LVX_FAULT_* act.
inline std::string lvx_faults_binary() { return lvx::testing::binary_dir() + "/lvx-faults"; }
inline std::string python() { return lvx::testing::configured_python(); }

// Removed when the process exits (a killed one leaves its folder; the name says whose it was).
inline fs::path workdir() {
  struct Dir {
    fs::path path = fs::temp_directory_path() / ("lvx_test_models_" + std::to_string(::getpid()));
    Dir() { fs::create_directories(path); }
    ~Dir() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  };
  static const Dir dir;
  return dir.path;
}

struct Diff {
  double logits = 0, loss = 0, grad = 0;
  std::string worst_grad;
  size_t grads = 0;
};

inline Diff compare(const std::string& got_path, const std::string& want_path) {
  auto got = lvx::load_safetensors(got_path).tensors,
       want = lvx::load_safetensors(want_path).tensors;
  Diff d;
  d.logits = (got.at("logits") - want.at("logits")).abs().max().item<double>();
  if (got.count("loss"))
    d.loss = std::abs(got.at("loss").item<double>() - want.at("loss").item<double>());
  for (const auto& [name, g] : got) {
    if (name.rfind("grad.", 0) != 0) continue;
    EXPECT_TRUE(want.count(name)) << name << " has no reference gradient";
    if (!want.count(name)) continue;
    const at::Tensor& w = want.at(name);
    const double e =
        (g - w).abs().max().item<double>() / std::max(1e-6, w.abs().max().item<double>());
    if (e > d.grad) d.grad = e, d.worst_grad = name;
    ++d.grads;
  }
  return d;
}

inline std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Where generated reference files live: LVX_TEST_CACHE, else $XDG_CACHE_HOME/lvx/test-references,
// else ~/.cache/lvx/test-references, each in a folder named after its generator and its stamp's
// hash, so that a fresh build tree (CI's) finds what an earlier one made, as ccache finds objects;
// LVX_TEST_CACHE=off: the build tree (build/tests/<name>), made again in each new one.
inline fs::path generated_root() {
  const char* env = std::getenv("LVX_TEST_CACHE");
  const std::string v = env ? env : "";
  if (v == "off" || v == "0" || v == "none") return fs::path(lvx::testing::binary_dir()) / "tests";
  if (!v.empty()) return v;
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  const fs::path base = xdg && *xdg ? fs::path(xdg) : fs::path(home ? home : "/tmp") / ".cache";
  return base / "lvx" / "test-references";
}

// 64-bit FNV-1a of the stamp, in hex: its folder's name beside the generator's.
inline std::string stamp_hash(const std::string& stamp) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : stamp) h = (h ^ c) * 1099511628211ull;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

// Reference files made by a Python generator (generated_root()/<name>-<hash of stamp>), made
// again only when `stamp` changes (the generator's source, the pinned packages, its arguments,
// or a version string its caller bumps when its own making changes): ctest runs every test in
// its own process, and generators take seconds (in CI's fresh build tree they were a fifth of
// the test time, two tests often making the same one at once). `make(dir)` fills a fresh folder
// and returns its log; concurrent processes each make their own folder and rename it into place.
// Returns the folder, or "" (with the log in *log) when the generator failed.
inline std::string generated(const std::string& name, const std::string& stamp,
                             const std::function<std::string(const std::string&)>& make,
                             std::string* log) {
  const fs::path root = generated_root();
  const bool in_build_tree = root == fs::path(lvx::testing::binary_dir()) / "tests";
  const std::string dir = (root / (in_build_tree ? name : name + "-" + stamp_hash(stamp))).string();
  auto fresh = [&] { return read_text(dir + "/stamp") == stamp; };
  if (fs::exists(dir + "/stamp") && fresh()) return dir;
  const std::string tmp = dir + ".tmp." + std::to_string(::getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  *log = make(tmp);
  if (log->find("exit status") != std::string::npos) return "";
  std::ofstream(tmp + "/stamp", std::ios::binary) << stamp;
  if (!(fs::exists(dir + "/stamp") && fresh())) {
    std::error_code ec;
    fs::remove_all(dir, ec);
    fs::rename(tmp, dir, ec);
  }
  fs::remove_all(tmp);
  return fs::exists(dir + "/stamp") && fresh() ? dir : "";
}

// The stamp of a reference script: its source and the pinned Python packages.
inline std::string script_stamp(const std::string& script) {
  return read_text(script) + read_text(lvx::testing::source_dir() + "/requirements.txt") +
         read_text(lvx::testing::source_dir() + "/requirements-nodeps.txt");
}

// A tiny reference model (its checkpoint directory), a batch and the reference's expected
// outputs (logits, loss, grad.<name>), made by a reference `script` with its make-model,
// make-batch and run --backward subcommands, once per generator version (generated()).
struct Reference {
  std::string model, batch, expected;
};

inline Reference reference_model(const std::string& name, const std::string& script,
                                 const std::string& stamp, const std::string& model_args,
                                 const std::string& batch_args) {
  const std::string py = python() + " " + script + " ";
  std::string log;
  const std::string d = generated(
      name, stamp + "\nmodel: " + model_args + "\nbatch: " + batch_args,
      [&](const std::string& dir) {
        const std::string model = dir + "/model", batch = dir + "/batch.safetensors";
        // One after the other (the operands of + have no evaluation order).
        std::string out = run_command(py + "make-model " + model + " " + model_args);
        out += run_command(py + "make-batch " + model + " " + batch + " " + batch_args);
        out += run_command(py + "run " + model + " " + batch + " " + dir +
                           "/expected.safetensors --backward");
        return out;
      },
      &log);
  EXPECT_FALSE(d.empty()) << log;
  return {d + "/model", d + "/batch.safetensors", d + "/expected.safetensors"};
}

// `lvx forward --backward` on the reference's batch (output named after `tag`), compared with
// the expected outputs; prints the differences.
inline Diff forward_against(const Reference& ref, const std::string& tag, int nproc,
                            const std::string& strategies, const std::string& flags) {
  const std::string out = (workdir() / (tag + "_out.safetensors")).string();
  fs::remove(out);
  const std::string log =
      run_command(lvx_binary() + " forward --model " + ref.model + " --input " + ref.batch +
                  " --output " + out + " --nproc " + std::to_string(nproc) + " --strategies " +
                  strategies + " --backward " + flags);
  EXPECT_TRUE(fs::exists(out)) << log;
  if (!fs::exists(out)) return Diff{1e30, 1e30, 1e30, "no output", 0};
  const Diff d = compare(out, ref.expected);
  std::cout << tag << " n=" << nproc << " " << strategies << " " << flags << ": logits " << d.logits
            << ", loss " << d.loss << ", grads " << d.grad << " (" << d.worst_grad << ", "
            << d.grads << " tensors)\n";
  return d;
}

// A gtest parameter name: letters and digits kept, everything else '_'.
inline std::string test_name(std::string s) {
  for (char& ch : s)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return s;
}

// Rank 0's bytes per decoded token for one cross layer under lead decoding (models/lead_decode.h),
// fp32: the query to each other rank, (n−1)·B·Hq·D·4 (their partials come back; it sends none).
inline int64_t lead_cross_bytes(int n, int64_t batch, int64_t heads, int64_t head_dim) {
  return int64_t{n - 1} * batch * heads * head_dim * 4;
}

// Greedy generation against a reference script's `generate` subcommand (a cache-less greedy loop,
// made once per generator version and reference: generated()): `lvx forward --generate` of
// `tokens` tokens on the reference's batch must give the same tokens and every step's logits
// within 1e-4. Returns the output's metadata (decode_bytes_sent_per_token, ...); empty on failure.
inline std::map<std::string, std::string> generate_against(
    const Reference& ref, const std::string& name, const std::string& script,
    const std::string& stamp, int nproc, const std::string& strategies, int tokens,
    const std::string& flags = "") {
  std::string log;
  const std::string dir = generated(
      name, stamp + "\ntokens: " + std::to_string(tokens) + "\nfrom: " + ref.model,
      [&](const std::string& d) {
        return run_command(python() + " " + script + " generate " + ref.model + " " + ref.batch +
                           " " + d + "/expected.safetensors --tokens " + std::to_string(tokens));
      },
      &log);
  EXPECT_FALSE(dir.empty()) << log;
  if (dir.empty()) return {};
  const std::string out =
      (workdir() / (name + "_n" + std::to_string(nproc) + test_name(flags) + ".safetensors"))
          .string();
  fs::remove(out);
  log = run_command(lvx_binary() + " forward --model " + ref.model + " --input " + ref.batch +
                    " --output " + out + " --nproc " + std::to_string(nproc) + " --strategies " +
                    strategies + " --generate " + std::to_string(tokens) + " " + flags);
  EXPECT_TRUE(fs::exists(out)) << log;
  if (!fs::exists(out)) return {};
  const lvx::TensorFile got = lvx::load_safetensors(out);
  const auto want = lvx::load_safetensors(dir + "/expected.safetensors").tensors;
  EXPECT_TRUE(at::equal(got.tensors.at("tokens"), want.at("tokens")))
      << got.tensors.at("tokens") << "\nreference:\n"
      << want.at("tokens");
  const double err =
      (got.tensors.at("step_logits") - want.at("step_logits")).abs().max().item<double>();
  EXPECT_LT(err, 1e-4);
  std::cout << name << " n=" << nproc << " " << strategies << ": step logits " << err
            << ", decode bytes/token " << got.metadata.at("decode_bytes_sent_per_token")
            << ", prefill bytes " << got.metadata.at("prefill_bytes_sent") << "\n";
  return got.metadata;
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
