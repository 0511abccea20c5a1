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

int cmd_attention_demo(int argc, char** argv) {
  cli::ArgParser p("lvx attention-demo [options]",
                   "Distributed cross-attention on a few local ranks with every strategy:\n"
                   "text queries attend to the visual tokens of several video clips.");
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
  if (!p.parse(argc, argv)) return 0;
  const int nproc = static_cast<int>(p.get_int("nproc"));
  const int64_t frames = p.get_int("frames"), tpf = p.get_int("tokens-per-frame");
  const int64_t sq = p.get_int("text"), skv = frames * tpf, clips = p.get_int("clips");
  const int64_t hq = p.get_int("heads"), hkv = p.get_int("kv-heads"), d = p.get_int("head-dim");
  LVX_CHECK(clips >= 1 && frames % clips == 0, "--frames (", frames, ") must divide into --clips (",
            clips, ")");
  const std::string dt_name = p.get("dtype");
  LVX_CHECK(dt_name == "float32" || dt_name == "bfloat16", "--dtype must be float32 or bfloat16");
  const auto dtype = dt_name == "float32" ? at::kFloat : at::kBFloat16;

  std::string dir = p.get("workdir");
  if (dir.empty()) {
    char tmpl[] = "/tmp/lvx_demo_XXXXXX";
    LVX_CHECK(::mkdtemp(tmpl) != nullptr, "cannot create a temporary folder");
    dir = tmpl;
  }
  fs::create_directories(dir);
  const std::string in = dir + "/input.safetensors";

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

  // Single-device result in float64.
  attention::AttentionSpec spec;
  spec.batch = 1;
  spec.sq = sq;
  spec.skv = skv;
  spec.hq = hq;
  spec.hkv = hkv;
  spec.head_dim = d;
  spec.mask = runtime::mask_kind_from_name(p.get("mask"), &spec.media_rule);
  attention::LocalInputs full{t["q"].to(at::kDouble),
                              t["k"].to(at::kDouble),
                              t["v"].to(at::kDouble),
                              {t["q_media"], t["kv_media"], {}}};
  auto params = attention::block_params(spec, full.mask, at::arange(sq), at::arange(skv));
  auto ref = kernels::attention_forward(full.q, full.k, full.v, params);
  auto ref_g =
      kernels::attention_backward(full.q, full.k, full.v, t["do"].to(at::kDouble), ref.lse,
                                  kernels::attention_delta(t["do"].to(at::kDouble), ref.o), params);

  std::cout << "lvx demo: cross-attention of " << sq << " text tokens to " << skv
            << " visual tokens (" << frames << " frames x " << tpf << ", " << clips << " clips), "
            << hq << " query / " << hkv << " K/V heads, head dim " << d << ", " << dt_name
            << ", mask " << p.get("mask") << ", forward + backward on " << nproc
            << " local ranks (Gloo)\n"
            << "errors are max |x - x_ref| against one device in float64; bytes are sent per "
               "rank, measured ((!) would mark a mismatch with the analytic volume)\n\n";
  std::cout << std::left << std::setw(11) << "strategy" << std::setw(11) << "err o" << std::setw(11)
            << "err dq" << std::setw(11) << "err dk" << std::setw(10) << "time s"
            << "bytes sent per rank\n";
  int failures = 0;
  for (const auto& name : p.get_list("strategies")) {
    auto strategy = attention::make_strategy(attention::strategy_from_name(name));
    try {
      strategy->check_supported(spec, nproc);
    } catch (const lvx::Error& e) {
      std::cout << std::setw(11) << name << "skipped: " << e.what() << "\n";
      continue;
    }
    const std::string out = dir + "/" + name + ".safetensors", stats = dir + "/" + name + ".json";
    dist::LaunchOptions o;
    o.nproc = nproc;
    o.capture = true;
    auto res = dist::launch_local(
        {dist::self_executable(), "attention", "--strategy", name, "--input", in, "--output", out,
         "--mask", p.get("mask"), "--backward", "--stats", stats},
        o);
    if (res.exit_code != 0) {
      std::cout << std::setw(11) << name << "FAILED: rank " << res.first_failed << " "
                << dist::describe_exit(res.exit_code) << "\n"
                << res.ranks[res.first_failed].output;
      ++failures;
      continue;
    }
    auto r = load_safetensors(out).tensors;
    std::ifstream sf(stats);
    auto js = nlohmann::json::parse(sf);
    double secs = 0;
    std::string bytes;
    for (int j = 0; j < nproc; ++j) {
      auto rank = js["ranks"][j];
      secs = std::max(secs, rank["seconds"].get<double>());
      const auto a = strategy->analytic_bytes(spec, nproc, j, dtype, false).sent +
                     strategy->analytic_bytes(spec, nproc, j, dtype, true).sent;
      const int64_t m = rank["bytes_sent"].get<int64_t>();
      char buf[64];
      std::snprintf(buf, sizeof(buf), "%s%.2fM%s", j ? " " : "", m / 1e6, m == a ? "" : "(!)");
      bytes += buf;
      if (m != a) ++failures;
    }
    char row[128];
    std::snprintf(row, sizeof(row), "%-11s%-11.2e%-11.2e%-11.2e%-10.3f", name.c_str(),
                  max_abs(r["o"], ref.o), max_abs(r["dq"], ref_g.dq), max_abs(r["dk"], ref_g.dk),
                  secs);
    std::cout << row << bytes << "\n";
  }
  std::cout << "\n(inputs and outputs in " << dir << "; run `lvx attention --help` to drive one "
            << "strategy yourself, `lvx plan --help` to choose per layer)\n";
  return failures ? 1 : 0;
}

}  // namespace

LVX_COMMAND("attention-demo", "every attention strategy side by side on local ranks (error, bytes)",
            cmd_attention_demo);
