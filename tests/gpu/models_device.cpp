// lvx_gpu_models: every family's tiny model on a device against the same binary on the CPU and
// against the reference package, through `lvx-core forward` (the GPU archive's step "models",
// tests/gpu/run.sh). Each folder under --models (made by tests/gpu/pack.sh with the reference
// scripts of tests/reference/: transformers' Qwen2/SigLIP for mPLUG-Owl3, open_flamingo's MPT
// for OpenFlamingo, transformers' Mllama) holds model/ (the checkpoint), batch.safetensors,
// expected.safetensors (the package's logits, loss and gradients, CPU) and generate.safetensors
// (its greedy loop without a cache). For each family:
//   fp32  forward+backward and 6 greedy tokens on --device and on the CPU. Gates (errors are
//         max |a − b| / max(1, max |b|), per tensor; the CPU run's own error against the
//         package is what the conformance tests bound by 1e-4):
//           device vs CPU      logits, loss, step logits <= 1e-4; each gradient <= 1e-3;
//                              greedy tokens equal
//           device vs package  logits, gradients <= 1e-4 (the conformance tests' bound);
//                              greedy tokens equal
//         and the batch's samples as generations stepped together (--generate-rows: serve's
//         continuous batching) on both: tokens equal to the batch's, step logits <= 1e-4
//         TF32 is off for this (run.sh sets NVIDIA_TF32_OVERRIDE=0): fp32 means fp32 here, so
//         the only differences left are summation orders (~1e-6).
//   bf16  forward+backward on --device against the CPU's fp32, gated by the CPU's own bf16
//         run (the dual-reference gate of tests/test_kernels.cpp): error <= 2·e_cpu_bf16 + 1e-2.
// With --device cpu (the CPU rehearsal) the "device" runs are CPU runs: the gates then check the
// harness, the files and the binary, not a GPU. Prints one line per check and exits 1 when any
// fails (2 for a usage error).
//
// Usage: lvx_gpu_models --lvx BIN --models DIR --device cuda|cpu --out DIR [--families a,b]
#include <ATen/ATen.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "src/common/error.h"
#include "src/common/safetensors.h"

namespace fs = std::filesystem;

namespace {

struct Options {
  std::string lvx, models, device = "cuda", out, families;
};

// Runs `cmd` with stderr joined to stdout; returns the exit status, the output in *log.
int run(const std::string& cmd, std::string* log) {
  FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return 127;
  char buf[4096];
  size_t got = 0;
  while ((got = std::fread(buf, 1, sizeof buf, p)) > 0) log->append(buf, got);
  const int st = ::pclose(p);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

// max |a − b| / max(1, max |b|), on the CPU in fp64.
double rel_error(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor x = a.to(at::kCPU, at::kDouble), y = b.to(at::kCPU, at::kDouble);
  if (x.sizes() != y.sizes()) return 1e300;
  if (x.numel() == 0) return 0;
  return (x - y).abs().max().item<double>() / std::max(1.0, y.abs().max().item<double>());
}

struct Diff {
  double logits = 0, loss = 0, grad = 0;
  std::string worst_grad;
  int64_t grads = 0;
};

// `got` against `want`: logits, loss and every grad.<name> of `got` (lvx's trainable parameters:
// all but the frozen vision tower; `want` may hold more, a missing one is an error).
Diff compare(const lvx::TensorFile& got, const lvx::TensorFile& want) {
  Diff d;
  d.logits = rel_error(got.tensors.at("logits"), want.tensors.at("logits"));
  if (want.tensors.count("loss")) {
    LVX_CHECK(got.tensors.count("loss"), "no loss in the output");
    d.loss = rel_error(got.tensors.at("loss"), want.tensors.at("loss"));
  }
  for (const auto& [name, g] : got.tensors) {
    if (name.rfind("grad.", 0) != 0) continue;
    LVX_CHECK(want.tensors.count(name), "no ", name, " to compare with");
    const double e = rel_error(g, want.tensors.at(name));
    if (e >= d.grad) d.grad = e, d.worst_grad = name;
    ++d.grads;
  }
  return d;
}

std::string sci(double x) {
  std::ostringstream o;
  o << std::setprecision(2) << std::scientific << x;
  return o.str();
}

class Check {
 public:
  explicit Check(const Options& o) : o_(o) {}

  // One `lvx-core forward`; returns its output file (throws with the log when it failed).
  lvx::TensorFile forward(const std::string& fam, const std::string& device,
                          const std::string& dtype, const std::string& extra) {
    const std::string dir = o_.models + "/" + fam;
    const std::string kind = extra.find("--generate-rows") != std::string::npos ? ".rows"
                             : extra.find("--generate") != std::string::npos   ? ".gen"
                                                                               : ".step";
    const std::string name = fam + "." + device + "." + dtype + kind;
    const std::string out = o_.out + "/" + name + ".safetensors";
    std::string log;
    const std::string cmd = o_.lvx + " forward --model " + dir + "/model --input " + dir +
                            "/batch.safetensors --output " + out + " --device " + device +
                            " --dtype " + dtype + " --threads 2 " + extra;
    const int rc = run(cmd, &log);
    std::ofstream(o_.out + "/" + name + ".log") << "$ " << cmd << "\n" << log;
    LVX_CHECK(rc == 0 && fs::exists(out), cmd, " failed (exit ", rc, "):\n", log);
    return lvx::load_safetensors(out);
  }

  void gate(const std::string& fam, const std::string& what, double err, double bound,
            const std::string& detail = "") {
    const bool ok = err <= bound;
    failed_ |= !ok;
    std::cout << std::left << std::setw(14) << fam << std::setw(52) << what << " " << std::setw(9)
              << sci(err) << " <= " << std::setw(9) << sci(bound) << (ok ? "  ok" : "  FAIL")
              << (detail.empty() ? "" : "  (" + detail + ")") << std::endl;
  }

  void expect(const std::string& fam, const std::string& what, bool ok,
              const std::string& detail) {
    failed_ |= !ok;
    std::cout << std::left << std::setw(14) << fam << std::setw(52) << what << " "
              << (ok ? "ok" : "FAIL") << "  (" << detail << ")" << std::endl;
  }

  void family(const std::string& fam) {
    const std::string dir = o_.models + "/" + fam;
    const lvx::TensorFile pkg = lvx::load_safetensors(dir + "/expected.safetensors");
    const lvx::TensorFile pkg_gen = lvx::load_safetensors(dir + "/generate.safetensors");
    const std::string dev = o_.device;
    // fp32, forward and backward.
    const lvx::TensorFile cpu = forward(fam, "cpu", "fp32", "--backward");
    const lvx::TensorFile on = forward(fam, dev, "fp32", "--backward");
    const Diff dc = compare(on, cpu), dp = compare(on, pkg);
    gate(fam, "fp32 " + dev + " vs cpu: logits", dc.logits, 1e-4);
    gate(fam, "fp32 " + dev + " vs cpu: loss", dc.loss, 1e-4);
    gate(fam, "fp32 " + dev + " vs cpu: worst of " + std::to_string(dc.grads) + " gradients",
         dc.grad, 1e-3, dc.worst_grad);
    gate(fam, "fp32 " + dev + " vs package: logits", dp.logits, 1e-4);
    gate(fam, "fp32 " + dev + " vs package: worst gradient", dp.grad, 1e-4, dp.worst_grad);
    // fp32 greedy decoding through the KV cache.
    const lvx::TensorFile gc = forward(fam, "cpu", "fp32", "--generate 6");
    const lvx::TensorFile gd = forward(fam, dev, "fp32", "--generate 6");
    const at::Tensor t_dev = gd.tensors.at("tokens"), t_cpu = gc.tensors.at("tokens");
    expect(fam, "fp32 " + dev + " greedy tokens = cpu = package",
           at::equal(t_dev, t_cpu) && at::equal(t_dev, pkg_gen.tensors.at("tokens")),
           std::to_string(t_dev.numel()) + " tokens");
    gate(fam, "fp32 " + dev + " vs cpu: step logits",
         rel_error(gd.tensors.at("step_logits"), gc.tensors.at("step_logits")), 1e-4);
    // The same samples as generations of their own stepped together (lvx serve's continuous
    // batching: Model::extend_rows, Model::decode_rows).
    const lvx::TensorFile rc = forward(fam, "cpu", "fp32", "--generate 6 --generate-rows");
    const lvx::TensorFile rd = forward(fam, dev, "fp32", "--generate 6 --generate-rows");
    expect(fam, "fp32 " + dev + " rows stepped together: tokens = batch's",
           at::equal(rd.tensors.at("tokens"), t_dev) && at::equal(rc.tensors.at("tokens"), t_cpu),
           std::to_string(t_dev.numel()) + " tokens");
    gate(fam, "fp32 " + dev + " rows vs cpu rows: step logits",
         rel_error(rd.tensors.at("step_logits"), rc.tensors.at("step_logits")), 1e-4);
    gate(fam, "fp32 " + dev + " rows vs " + dev + " batch: step logits",
         rel_error(rd.tensors.at("step_logits"), gd.tensors.at("step_logits")), 1e-4);
    // bf16 against fp32, gated by the CPU's own bf16 error.
    const lvx::TensorFile cpu16 = forward(fam, "cpu", "bf16", "--backward");
    const lvx::TensorFile on16 = forward(fam, dev, "bf16", "--backward");
    const Diff ref16 = compare(cpu16, cpu), got16 = compare(on16, cpu);
    gate(fam, "bf16 " + dev + " vs fp32 cpu: logits", got16.logits, 2 * ref16.logits + 1e-2,
         "cpu bf16: " + sci(ref16.logits));
    gate(fam, "bf16 " + dev + " vs fp32 cpu: worst gradient", got16.grad, 2 * ref16.grad + 1e-2,
         got16.worst_grad + "; cpu bf16: " + sci(ref16.grad));
  }

  bool failed() const { return failed_; }

 private:
  Options o_;
  bool failed_ = false;
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) v.push_back(x);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::cerr << "lvx_gpu_models: " << a << " needs a value\n";
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--lvx") o.lvx = value();
    else if (a == "--models") o.models = value();
    else if (a == "--device") o.device = value();
    else if (a == "--out") o.out = value();
    else if (a == "--families") o.families = value();
    else {
      std::cerr << "lvx_gpu_models: unknown argument '" << a
                << "' (usage: --lvx BIN --models DIR --device cuda|cpu --out DIR [--families "
                   "a,b])\n";
      return 2;
    }
  }
  if (o.lvx.empty() || o.models.empty() || o.out.empty() ||
      (o.device != "cuda" && o.device != "cpu")) {
    std::cerr << "lvx_gpu_models: usage: --lvx BIN --models DIR --device cuda|cpu --out DIR\n";
    return 2;
  }
  try {
    fs::create_directories(o.out);
    std::vector<std::string> families = split(o.families);
    if (families.empty())
      for (const auto& e : fs::directory_iterator(o.models))
        if (e.is_directory()) families.push_back(e.path().filename().string());
    std::sort(families.begin(), families.end());
    LVX_CHECK(!families.empty(), o.models, ": no family folders");
    Check check(o);
    for (const std::string& f : families) check.family(f);
    std::cout << (check.failed() ? "FAILED" : "passed") << ": " << families.size()
              << " families on " << o.device << "\n";
    return check.failed() ? 1 : 0;
  } catch (const std::exception& e) {
    std::cerr << "lvx_gpu_models: error: " << e.what() << "\n";
    return 1;
  }
}
