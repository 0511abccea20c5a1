// `lvx attention-demo`: every distributed attention strategy side by side. A video-QA-shaped
// cross-attention (text queries against the visual tokens of several clips under a media mask,
// GQA) runs with every strategy on N real local ranks, forward and backward; it prints what ran,
// the error against a single-device float64 result, and the bytes each rank sent (measured, and
// the strategy's analytic volume).
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>

#include "kernels/attention.h"
#include "src/attention/strategy.h"
#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/error.h"
#include "src/common/safetensors.h"
#include "src/dist/launcher.h"
#include "src/runtime/attention_job.h"

namespace {

namespace fs = std::filesystem;
using namespace lvx;

double max_abs(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// The options of `lvx attention-demo`.
void add_attention_demo_options(cli::ArgParser& p) {
  p.add_option("nproc", 'n', "4", "local ranks");
  p.add_option("frames", 'f', "32", "video frames (visual tokens = frames x tokens-per-frame)");
  p.add_option("tokens-per-frame", 0, "128", "visual tokens per frame");
  p.add_option("text", 't', "512", "text tokens (queries)");
  p.add_option("heads", 0, "8", "query heads");
  p.add_option("kv-heads", 0, "2", "key/value heads (GQA)");
  p.add_option("head-dim", 0, "64", "head dimension");
  p.add_option("clips", 0, "4", "video clips in the prompt (media)");
  p.add_option("mask", 'm', "media_upto", "none | causal | media_immediate | media_upto");
  p.add_option("dtype", 0, "float32", "float32 | bfloat16");
  p.add_option("strategies", 's', "lv_xattn,ring,striped,ulysses,all_gather", "strategies to run");
  p.add_option("workdir", 'w', "", "where inputs/outputs go (default: a temporary folder)");
}

// The demo's problem: ranks, sizes, clips and dtype.
struct DemoProblem {
  int nproc = 0;
  int64_t frames = 0, tpf = 0, sq = 0, skv = 0, clips = 0, hq = 0, hkv = 0, d = 0;
  std::string dt_name;
  at::ScalarType dtype = at::kFloat;
};

// The problem from the flags, checked (frames divide into clips; a dtype the demo runs).
DemoProblem problem_of(const cli::ArgParser& p) {
  DemoProblem s;
  s.nproc = static_cast<int>(p.get_int("nproc"));
  s.frames = p.get_int("frames");
  s.tpf = p.get_int("tokens-per-frame");
  s.sq = p.get_int("text");
  s.skv = s.frames * s.tpf;
  s.clips = p.get_int("clips");
  s.hq = p.get_int("heads");
  s.hkv = p.get_int("kv-heads");
  s.d = p.get_int("head-dim");
  LVX_CHECK(s.clips >= 1 && s.frames % s.clips == 0, "--frames (", s.frames,
            ") must divide into --clips (", s.clips, ")");
  s.dt_name = p.get("dtype");
  LVX_CHECK(s.dt_name == "float32" || s.dt_name == "bfloat16",
            "--dtype must be float32 or bfloat16");
  s.dtype = s.dt_name == "float32" ? at::kFloat : at::kBFloat16;
  return s;
}

// The folder inputs and outputs go to: --workdir, else a new temporary one; created.
std::string work_dir_of(const cli::ArgParser& p) {
  std::string dir = p.get("workdir");
  if (dir.empty()) {
    char tmpl[] = "/tmp/lvx_demo_XXXXXX";
    LVX_CHECK(::mkdtemp(tmpl) != nullptr, "cannot create a temporary folder");
    dir = tmpl;
  }
  fs::create_directories(dir);
  return dir;
}

// Random q, k, v, the output gradient and the media indices, saved to `in` and returned.
std::map<std::string, at::Tensor> write_inputs(const DemoProblem& s, const std::string& in) {
  const int64_t sq = s.sq, skv = s.skv, clips = s.clips, hq = s.hq, hkv = s.hkv, d = s.d;
  const auto dtype = s.dtype;
  // Inputs: clip c's visual tokens carry media index c; text before the first clip sees nothing,
  // later text sees the clips before it (media_upto) or only the latest (media_immediate).
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2026);
  std::map<std::string, at::Tensor> t{
      {"q", at::randn({1, sq, hq, d}, gen).to(dtype)},
      {"k", at::randn({1, skv, hkv, d}, gen).to(dtype)},
      {"v", at::randn({1, skv, hkv, d}, gen).to(dtype)},
      {"do", at::randn({1, sq, hq, d}, gen).to(dtype)},
      {"kv_media", at::div(at::arange(skv) * clips, skv, "floor").to(at::kInt).view({1, -1})},
      {"q_media",
       (at::div(at::arange(sq) * (clips + 1), sq, "floor") - 1).to(at::kInt).view({1, -1})}};
  save_safetensors(in, t);
  return t;
}

// The attention problem every strategy runs: the demo's sizes under the --mask mask.
attention::AttentionSpec spec_of(const DemoProblem& s, const std::string& mask) {
  attention::AttentionSpec spec;
  spec.batch = 1;
  spec.sq = s.sq;
  spec.skv = s.skv;
  spec.hq = s.hq;
  spec.hkv = s.hkv;
  spec.head_dim = s.d;
  spec.mask = runtime::mask_kind_from_name(mask, &spec.media_rule);
  return spec;
}

// What the strategies' outputs are compared with.
struct Reference {
  at::Tensor o, dq, dk;
};

// Single-device result in float64.
Reference reference_of(const attention::AttentionSpec& spec, std::map<std::string, at::Tensor>& t) {
  const int64_t sq = spec.sq, skv = spec.skv;
  attention::LocalInputs full{t["q"].to(at::kDouble),
                              t["k"].to(at::kDouble),
                              t["v"].to(at::kDouble),
                              {t["q_media"], t["kv_media"], {}}};
  auto params = attention::block_params(spec, full.mask, at::arange(sq), at::arange(skv));
  auto ref = kernels::attention_forward(full.q, full.k, full.v, params);
  auto ref_g =
      kernels::attention_backward(full.q, full.k, full.v, t["do"].to(at::kDouble), ref.lse,
                                  kernels::attention_delta(t["do"].to(at::kDouble), ref.o), params);
  return {ref.o, ref_g.dq, ref_g.dk};
}

// What runs, what the columns mean, and the table's header row.
void print_header(const DemoProblem& s, const std::string& mask) {
  std::cout << "lvx demo: cross-attention of " << s.sq << " text tokens to " << s.skv
            << " visual tokens (" << s.frames << " frames x " << s.tpf << ", " << s.clips
            << " clips), " << s.hq << " query / " << s.hkv << " K/V heads, head dim " << s.d << ", "
            << s.dt_name << ", mask " << mask << ", forward + backward on " << s.nproc
            << " local ranks (Gloo)\n"
            << "errors are max |x - x_ref| against one device in float64; bytes are sent per "
               "rank, measured ((!) would mark a mismatch with the analytic volume)\n\n";
  std::cout << std::left << std::setw(11) << "strategy" << std::setw(11) << "err o" << std::setw(11)
            << "err dq" << std::setw(11) << "err dk" << std::setw(10) << "time s"
            << "bytes sent per rank\n";
}

// From the run's stats js: the slowest rank's seconds into secs, and each rank's bytes sent,
// "(!)" marking (and failures counting) a mismatch with the strategy's analytic volume.
std::string bytes_sent(nlohmann::json& js, const attention::Strategy& strategy,
                       const attention::AttentionSpec& spec, const DemoProblem& s, double& secs,
                       int& failures) {
  const int nproc = s.nproc;
  const auto dtype = s.dtype;
  std::string bytes;
  for (int j = 0; j < nproc; ++j) {
    auto rank = js["ranks"][j];
    secs = std::max(secs, rank["seconds"].get<double>());
    const auto a = strategy.analytic_bytes(spec, nproc, j, dtype, false).sent +
                   strategy.analytic_bytes(spec, nproc, j, dtype, true).sent;
    const int64_t m = rank["bytes_sent"].get<int64_t>();
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%s%.2fM%s", j ? " " : "", m / 1e6, m == a ? "" : "(!)");
    bytes += buf;
    if (m != a) ++failures;
  }
  return bytes;
}

// Runs strategy `name` on the local ranks through `lvx attention` (forward and backward) and
// prints its row, or why it was skipped or failed; returns the failures it counted.
int run_strategy(const std::string& name, const DemoProblem& s,
                 const attention::AttentionSpec& spec, const Reference& ref, const std::string& dir,
                 const std::string& in, const std::string& mask) {
  const int nproc = s.nproc;
  int failures = 0;
  auto strategy = attention::make_strategy(attention::strategy_from_name(name));
  try {
    strategy->check_supported(spec, nproc);
  } catch (const lvx::Error& e) {
    std::cout << std::setw(11) << name << "skipped: " << e.what() << "\n";
    return failures;
  }
  const std::string out = dir + "/" + name + ".safetensors", stats = dir + "/" + name + ".json";
  dist::LaunchOptions o;
  o.nproc = nproc;
  o.capture = true;
  auto res =
      dist::launch_local({dist::self_executable(), "attention", "--strategy", name, "--input", in,
                          "--output", out, "--mask", mask, "--backward", "--stats", stats},
                         o);
  if (res.exit_code != 0) {
    std::cout << std::setw(11) << name << "FAILED: rank " << res.first_failed << " "
              << dist::describe_exit(res.exit_code) << "\n"
              << res.ranks[res.first_failed].output;
    ++failures;
    return failures;
  }
  auto r = load_safetensors(out).tensors;
  std::ifstream sf(stats);
  auto js = nlohmann::json::parse(sf);
  double secs = 0;
  const std::string bytes = bytes_sent(js, *strategy, spec, s, secs, failures);
  char row[128];
  std::snprintf(row, sizeof(row), "%-11s%-11.2e%-11.2e%-11.2e%-10.3f", name.c_str(),
                max_abs(r["o"], ref.o), max_abs(r["dq"], ref.dq), max_abs(r["dk"], ref.dk), secs);
  std::cout << row << bytes << "\n";
  return failures;
}

int cmd_attention_demo(int argc, char** argv) {
  cli::ArgParser p("lvx attention-demo [options]",
                   "Distributed cross-attention on a few local ranks with every strategy:\n"
                   "text queries attend to the visual tokens of several video clips.");
  add_attention_demo_options(p);
  if (!p.parse(argc, argv)) return 0;
  const DemoProblem s = problem_of(p);

  const std::string dir = work_dir_of(p);
  const std::string in = dir + "/input.safetensors";
  std::map<std::string, at::Tensor> t = write_inputs(s, in);
  const attention::AttentionSpec spec = spec_of(s, p.get("mask"));
  const Reference ref = reference_of(spec, t);

  print_header(s, p.get("mask"));
  int failures = 0;
  for (const auto& name : p.get_list("strategies"))
    failures += run_strategy(name, s, spec, ref, dir, in, p.get("mask"));
  std::cout << "\n(inputs and outputs in " << dir << "; run `lvx attention --help` to drive one "
            << "strategy yourself, `lvx plan --help` to choose per layer)\n";
  return failures ? 1 : 0;
}

}  // namespace

LVX_COMMAND("attention-demo", "every attention strategy side by side on local ranks (error, bytes)",
            cmd_attention_demo);
