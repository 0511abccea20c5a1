// One binary, the one the GPU archive ships; its parts beside it: the correctness phase
// (kernel_checks.cpp), the results table (kernel_table.cpp) and the profile (kernel_profile.cpp).
// Local attention kernels: correctness first (every mask x dtype x head layout against the fp64
// dense reference with the dual-reference gate, on CPU and, when present, CUDA), then timing
// side by side with a baseline in the same run: on CPU lvx's local forward and forward+backward
// against at::scaled_dot_product_attention on the same tensors (masks none / causal / media,
// MHA and GQA; ratio = SDPA time / lvx time, rate over visible pairs), on CUDA against
// at::_scaled_dot_product_flash_attention and cuDNN attention. Warm-up, repeats, median (and
// min/max spread; CUDA forwards also back to back, one synchronisation for all repeats, as a
// model's layers run); -o md|json.
//
//   bench_kernels [--shapes 2048x2048,1024x16384] [--masks none,causal,mediaUpTo] [--heads 8]
//                 [--hkv 8,2] [--dim 64] [--dtype fp32] [--device cpu,cuda] [--reps 3]
//                 [--warmup 1] [-o md|json]
//                 [--memory-demo] [--check-only]      (--help: defaults and LVX_* env mirrors)
//                 [--profile DIR]  (instead of the table: per shape, where lvx's and the baseline's
//                                   time goes; Chrome traces in DIR, benchmarks/kernel_profile.h)
#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/kernel_checks.h"
#include "benchmarks/kernel_profile.h"
#include "benchmarks/kernel_table.h"
#include "kernels/attention.h"
#include "src/cli/args.h"
#include "src/common/device_sync.h"
#include "src/common/dtype.h"
#include "src/common/error.h"


using namespace lvx::kernels;
using lvx::bench::dtype_name;
using lvx::bench::implausible_rate;
using lvx::bench::mask_name;
using lvx::bench::MaskCase;
using lvx::bench::print_rows;
using lvx::bench::Row;
using lvx::bench::run_checks;

namespace {

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) {
    if (!x.empty()) out.push_back(x);
  }
  return out;
}

// lvx's dtype names (src/common/dtype.h), plus fp64 for the CPU reference precision.
at::ScalarType parse_dtype(const std::string& s) {
  return s == "fp64" ? at::kDouble : lvx::dtype_of(s, "--dtype (or fp64)");
}

bool cuda_present() { return at::hasCUDA(); }

struct Timing {
  double median_s = 0, min_s = 0, max_s = 0;
};

Timing time_it(const std::function<void()>& fn, const at::Device& dev, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) fn();
  lvx::synchronize(dev);
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    lvx::synchronize(dev);
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return {t[t.size() / 2], t.front(), t.back()};
}

#ifdef LVX_WITH_CUDA
// Calls issued back to back, one synchronisation at the end (as a model's layers run): the host
// work of one call overlaps the device work of the one before. Mean per call.
double time_back_to_back(const std::function<void()>& fn, const at::Device& dev, int warmup,
                         int reps) {
  for (int i = 0; i < warmup; ++i) fn();
  lvx::synchronize(dev);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < reps; ++i) fn();
  lvx::synchronize(dev);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
}
#endif

// ---------------------------------------------------------------------------------------------
// Timing.

// The timing masks: none, causal (bottom-right aligned, as a ring block at the diagonal's end;
// square shapes are exactly SDPA's is_causal), and the LV-XAttn media mask (mPLUG-Owl3 up-to
// rule, 4 media of Skv/4 keys each, queries in media order: a staircase).
AttentionMask timing_mask(MaskCase c, int64_t sq, int64_t skv) {
  AttentionMask m;
  if (c == MaskCase::kCausal) {
    m.kind = MaskKind::kCausal;
    m.q_pos = at::arange(sq, at::kLong) + (skv - sq);
    m.k_pos = at::arange(skv, at::kLong);
  } else if (c == MaskCase::kMediaUpTo || c == MaskCase::kMediaImmediate) {
    m.kind = MaskKind::kMedia;
    m.media_rule = c == MaskCase::kMediaImmediate ? MediaRule::kImmediate : MediaRule::kUpTo;
    m.q_media = (at::arange(sq, at::kLong) * 4 / sq).to(at::kInt).unsqueeze(0).contiguous();
    m.kv_media = (at::arange(skv, at::kLong) * 4 / skv).to(at::kInt).unsqueeze(0).contiguous();
  }
  return m;
}

// lvx's local forward and forward+backward against at::scaled_dot_product_attention on the CPU,
// side by side in one run on the same tensors (SDPA gets [B, H, S, D] views, enable_gqa for
// GQA, is_causal for square causal, a boolean mask otherwise); outputs compared first.
void bench_cpu(std::vector<Row>& rows, MaskCase mc, int64_t sq, int64_t skv, int64_t h, int64_t hkv,
               int64_t d, at::ScalarType dt, int warmup, int reps) {
  at::manual_seed(3);
  auto q = at::randn({1, sq, h, d}).to(dt), k = at::randn({1, skv, hkv, d}).to(dt);
  auto v = at::randn({1, skv, hkv, d}).to(dt), dout = at::randn({1, sq, h, d}).to(dt);
  AttentionParams p;
  p.mask = timing_mask(mc, sq, skv);
  const double pairs = static_cast<double>(visible_pairs(p.mask, 1, sq, skv));
  const double flops = 4.0 * h * pairs * d;
  const bool causal_sq = mc == MaskCase::kCausal && sq == skv;
  std::optional<at::Tensor> sdpa_mask;
  if (mc != MaskCase::kNone && !causal_sq) {
    sdpa_mask = mask_matrix(p.mask, 1, sq, skv).unsqueeze(1);  // [1, 1, Sq, Skv] bool
  }
  auto qh = q.transpose(1, 2), kh = k.transpose(1, 2), vh = v.transpose(1, 2);
  auto sdpa = [&](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c) {
    return at::scaled_dot_product_attention(a, b, c, sdpa_mask, 0.0, causal_sq, std::nullopt,
                                            hkv != h);
  };
  // Correctness first: lvx's o against SDPA's on rows that see some key.
  AttentionOutput out = attention_forward(q, k, v, p);
  {
    at::Tensor ref = sdpa(qh, kh, vh).transpose(1, 2).to(at::kFloat);
    at::Tensor seen = out.lse.isfinite().transpose(1, 2).unsqueeze(-1);  // [1, Sq, H, 1]
    const double e = (at::where(seen, out.o - ref, at::zeros_like(ref))).abs().max().item<double>();
    const double tol = dt == at::kFloat ? 1e-4 : 3e-2;
    LVX_CHECK(e <= tol, "bench_kernels: lvx and SDPA outputs differ by ", e, " (tolerance ", tol,
              ") at ", mask_name(mc), " Sq=", sq, " Skv=", skv, " H=", h, " Hkv=", hkv);
  }
  auto tf = time_it([&] { out = attention_forward(q, k, v, p); }, at::kCPU, warmup, reps);
  auto ts = time_it([&] { sdpa(qh, kh, vh); }, at::kCPU, warmup, reps);
  rows.push_back({"cpu", dtype_name(dt), std::string("fwd ") + mask_name(mc), sq, skv, h, hkv, d,
                  tf.median_s, flops / tf.median_s / 1e9, flops / ts.median_s / 1e9, "sdpa",
                  tf.max_s / tf.min_s});
  auto tb = time_it(
      [&] {
        auto o = attention_forward(q, k, v, p);
        attention_backward(q, k, v, dout, o.lse, attention_delta(dout, o.o), p);
      },
      at::kCPU, warmup, reps);
  auto dh = dout.transpose(1, 2);
  auto tsb = time_it(
      [&] {
        auto a = qh.detach().requires_grad_(true), b = kh.detach().requires_grad_(true);
        auto c = vh.detach().requires_grad_(true);
        sdpa(a, b, c).backward(dh);
      },
      at::kCPU, warmup, reps);
  rows.push_back({"cpu", dtype_name(dt), std::string("fwd+bwd ") + mask_name(mc), sq, skv, h, hkv,
                  d, tb.median_s, 3.5 * flops / tb.median_s / 1e9, 3.5 * flops / tsb.median_s / 1e9,
                  "sdpa", tb.max_s / tb.min_s});
}

#ifdef LVX_WITH_CUDA
void bench_cuda(std::vector<Row>& rows, int64_t sq, int64_t skv, int64_t h, int64_t hkv, int64_t d,
                at::ScalarType dt, int warmup, int reps) {
  const at::Device dev(at::kCUDA, 0);
  auto opts = at::TensorOptions().dtype(dt).device(dev);
  auto q = at::randn({1, sq, h, d}, opts), k = at::randn({1, skv, hkv, d}, opts);
  auto v = at::randn({1, skv, hkv, d}, opts), dout = at::randn({1, sq, h, d}, opts);
  AttentionParams p;
  const double flops = 4.0 * h * sq * skv * d;
  // Baselines take [B, H, S, D] and equal head counts (K/V expanded for GQA).
  auto qh = q.transpose(1, 2).contiguous();
  auto kh = k.repeat_interleave(h / hkv, 2).transpose(1, 2).contiguous();
  auto vh = v.repeat_interleave(h / hkv, 2).transpose(1, 2).contiguous();
  auto doh = dout.transpose(1, 2).contiguous();
  double flash = 0, cudnn = 0, flash_bwd = 0;
  if (dt == at::kBFloat16 || dt == at::kHalf) {
    try {
      auto t =
          time_it([&] { at::_scaled_dot_product_flash_attention(qh, kh, vh); }, dev, warmup, reps);
      flash = flops / t.median_s / 1e12;
      auto f = at::_scaled_dot_product_flash_attention(qh, kh, vh);
      auto tb = time_it(
          [&] {
            at::_scaled_dot_product_flash_attention_backward(
                doh, qh, kh, vh, std::get<0>(f), std::get<1>(f), std::get<2>(f), std::get<3>(f),
                std::get<4>(f).expect_int(), std::get<5>(f).expect_int(), 0.0, false,
                std::get<6>(f), std::get<7>(f));
          },
          dev, warmup, reps);
      flash_bwd = 2.5 * flops / tb.median_s / 1e12;
    } catch (const std::exception& e) {
      std::cerr << "flash baseline unavailable: " << e.what() << "\n";
    }
    try {
      auto t =
          time_it([&] { at::_scaled_dot_product_cudnn_attention(qh, kh, vh, std::nullopt, true); },
                  dev, warmup, reps);
      cudnn = flops / t.median_s / 1e12;
    } catch (const std::exception& e) {
      std::cerr << "cuDNN baseline unavailable: " << std::string(e.what()).substr(0, 200) << "\n";
    }
  }
  AttentionOutput out;
  auto tf = time_it([&] { out = attention_forward(q, k, v, p); }, dev, warmup, reps);
  const double rate = flops / tf.median_s / 1e12;
  rows.push_back({"cuda", dtype_name(dt), "fwd", sq, skv, h, hkv, d, tf.median_s, rate, flash,
                  "sdpa_flash", tf.max_s / tf.min_s});
  rows.push_back({"cuda", dtype_name(dt), "fwd", sq, skv, h, hkv, d, tf.median_s, rate, cudnn,
                  "sdpa_cudnn", tf.max_s / tf.min_s});
  // Back to back (no synchronisation between calls), against flash the same way.
  if (flash > 0) {
    const double b2b = time_back_to_back([&] { attention_forward(q, k, v, p); }, dev, warmup, reps);
    const double fb2b = time_back_to_back(
        [&] { at::_scaled_dot_product_flash_attention(qh, kh, vh); }, dev, warmup, reps);
    rows.push_back({"cuda", dtype_name(dt), "fwd back-to-back", sq, skv, h, hkv, d, b2b,
                    flops / b2b / 1e12, flops / fb2b / 1e12, "sdpa_flash", 1.0});
  }
  auto delta = attention_delta(dout, out.o);
  auto tb =
      time_it([&] { attention_backward(q, k, v, dout, out.lse, delta, p); }, dev, warmup, reps);
  rows.push_back({"cuda", dtype_name(dt), "bwd", sq, skv, h, hkv, d, tb.median_s,
                  2.5 * flops / tb.median_s / 1e12, flash_bwd, "sdpa_flash_bwd",
                  tb.max_s / tb.min_s});
}
#endif

// 1k queries x 1M keys on CPU: peak RSS must stay far below the 4 GiB a materialized fp32 score
// matrix would need.
void memory_demo() {
  const int64_t sq = 1024, skv = int64_t{1} << 20, d = 64;
  auto q = at::randn({1, sq, 1, d}).to(at::kBFloat16);
  auto k = at::randn({1, skv, 1, d}).to(at::kBFloat16);
  auto v = at::randn({1, skv, 1, d}).to(at::kBFloat16);
  rusage before{};
  getrusage(RUSAGE_SELF, &before);
  const auto t0 = std::chrono::steady_clock::now();
  auto out = attention_forward(q, k, v, {});
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  rusage after{};
  getrusage(RUSAGE_SELF, &after);
  std::cout << "memory demo: Sq=1024 Skv=1048576 H=1 D=64 bf16 forward in " << s << " s; peak RSS "
            << after.ru_maxrss / 1024 << " MiB (inputs " << 2 * skv * d * 2 / (1 << 20)
            << " MiB; materialized fp32 scores would be " << sq * skv * 4 / (1 << 20)
            << " MiB); lse finite: " << out.lse.isfinite().all().item<bool>() << "\n";
}

// The command line, parsed and checked.
struct Options {
  std::string format, profile;
  int reps = 0, warmup = 0;
  bool check_only = false, demo = false, verbose = false;
  std::vector<std::pair<int64_t, int64_t>> shapes;  // (Sq, Skv)
  std::vector<MaskCase> masks;
  std::vector<int64_t> heads, hkv, dims;
  std::vector<std::string> dtypes;
  std::vector<at::Device> devices;
};

// Declares bench_kernels' flags (their defaults show in --help).
void add_options(lvx::cli::ArgParser& args) {
  args.add_option("shapes", 's', "2048x2048,1024x16384",
                  "SqxSkv shapes (comma list): square and LV-XAttn (1k queries x 16k-64k keys)");
  args.add_option("sq", 'q', "", "query counts (comma list; with --skv, replaces --shapes)");
  args.add_option("skv", 'k', "", "key counts (comma list; with --sq, replaces --shapes)");
  args.add_option("masks", 'm', "none,causal,mediaUpTo",
                  "CPU timing masks: none, causal, mediaUpTo, mediaImm (comma list)");
  args.add_option("heads", 'H', "8", "query heads (comma list)");
  args.add_option("hkv", 0, "8,2", "K/V heads (comma list; those that divide heads are run)");
  args.add_option("dim", 'd', "64", "head dims (comma list)");
  args.add_option("dtype", 't', "fp32", "input dtypes: fp32, fp64, bf16, fp16 (comma list)");
  args.add_option("device", 0, cuda_present() ? "cpu,cuda" : "cpu", "devices: cpu, cuda");
  args.add_option("reps", 'r', "3", "timed repeats (median reported)");
  args.add_option("warmup", 'w', "1", "warm-up runs");
  args.add_option("output", 'o', "md", "output format: md or json (JSON lines)");
  args.add_flag("check-only", 0, "run the correctness phase only");
  args.add_flag("memory-demo", 0, "CPU forward of 1024 queries x 1M keys, peak RSS");
  args.add_flag("verbose", 'v', "print every correctness comparison");
  args.add_option("profile", 0, "",
                  "profile instead of timing: per shape and device, lvx vs the baseline under "
                  "PyTorch's profiler; Chrome traces into this folder, a summary to stdout");
}

// --sq x --skv (every pair) when either is given, else --shapes' SQxSKV items.
std::vector<std::pair<int64_t, int64_t>> parse_shapes(const lvx::cli::ArgParser& args) {
  std::vector<std::pair<int64_t, int64_t>> shapes;
  if (!args.get("sq").empty() || !args.get("skv").empty()) {
    for (int64_t sq : args.get_int_list("sq")) {
      for (int64_t skv : args.get_int_list("skv")) shapes.emplace_back(sq, skv);
    }
  } else {
    for (const auto& x : split(args.get("shapes"))) {
      const auto at = x.find('x');
      LVX_CHECK(at != std::string::npos, "--shapes: expected SQxSKV, got '", x, "'");
      shapes.emplace_back(std::stoll(x.substr(0, at)), std::stoll(x.substr(at + 1)));
    }
  }
  return shapes;
}

// --masks by name (padding is a correctness case only).
std::vector<MaskCase> parse_masks(const std::string& list) {
  std::vector<MaskCase> masks;
  for (const auto& m : split(list)) {
    const MaskCase all[] = {MaskCase::kNone, MaskCase::kCausal, MaskCase::kMediaImmediate,
                            MaskCase::kMediaUpTo};
    bool found = false;
    for (MaskCase c : all) {
      if (m == mask_name(c)) {
        masks.push_back(c);
        found = true;
      }
    }
    LVX_CHECK(found, "--masks: expected none, causal, mediaImm or mediaUpTo, got '", m, "'");
  }
  return masks;
}

// --device: cpu and cuda (device 0, refused when absent).
std::vector<at::Device> parse_devices(const std::string& list) {
  std::vector<at::Device> devices;
  for (const auto& d : split(list)) {
    LVX_CHECK(d == "cpu" || d == "cuda", "--device: expected cpu or cuda, got '", d, "'");
    if (d == "cuda") {
      LVX_CHECK(cuda_present(), "--device cuda: no CUDA device (or built without CUDA)");
      devices.emplace_back(at::kCUDA, 0);
    } else {
      devices.emplace_back(at::kCPU);
    }
  }
  return devices;
}

// Reads and checks every option, in the order their errors are reported.
Options parse_options(const lvx::cli::ArgParser& args) {
  Options o;
  o.format = args.get("output");
  o.reps = static_cast<int>(args.get_int("reps"));
  o.warmup = static_cast<int>(args.get_int("warmup"));
  o.check_only = args.flag("check-only");
  o.demo = args.flag("memory-demo");
  o.verbose = args.flag("verbose");
  const std::string device_s = args.get("device");
  o.hkv = args.get_int_list("hkv");
  o.shapes = parse_shapes(args);
  o.masks = parse_masks(args.get("masks"));
  o.heads = args.get_int_list("heads");
  o.dims = args.get_int_list("dim");
  o.dtypes = args.get_list("dtype");
  LVX_CHECK(o.format == "md" || o.format == "json", "-o: expected md or json, got '", o.format,
            "'");
  o.devices = parse_devices(device_s);
  o.profile = args.get("profile");
  return o;
}

// Correctness first: the devices whose kernels pass the check (a failing one is not timed);
// counts the others in `failed_devices`.
std::vector<at::Device> checked_devices(const Options& o, int& failed_devices) {
  std::vector<at::Device> checked;
  for (const auto& dev : o.devices) {
    if (run_checks(dev, o.verbose) == 0) {
      checked.push_back(dev);
    } else {
      ++failed_devices;
      std::cerr << "bench_kernels: correctness check failed on " << dev << "; not timing it\n";
    }
  }
  return checked;
}

// One configuration on one device: profiled (--profile), else timed into `rows` (CUDA: its
// baselines; CPU: once per timing mask).
void time_config(std::vector<Row>& rows, const Options& o, const at::Device& dev,
                 const std::string& dt, int64_t sq, int64_t skv, int64_t h, int64_t hkv,
                 int64_t d) {
  std::cerr << "timing " << dev << " " << dt << " Sq=" << sq << " Skv=" << skv << " H=" << h
            << " Hkv=" << hkv << " D=" << d << "\n";
  if (!o.profile.empty()) {
    lvx::bench::profile_attention(o.profile, dev, parse_dtype(dt), sq, skv, h, hkv, d, o.warmup,
                                  o.reps);
  } else if (dev.is_cuda()) {
#ifdef LVX_WITH_CUDA
    bench_cuda(rows, sq, skv, h, hkv, d, parse_dtype(dt), o.warmup, o.reps);
#endif
  } else {
    for (MaskCase mc : o.masks) {
      bench_cpu(rows, mc, sq, skv, h, hkv, d, parse_dtype(dt), o.warmup, o.reps);
    }
  }
}

// Every device x dtype x shape x heads x K/V heads (those dividing heads) x head dim.
std::vector<Row> time_all(const Options& o, const std::vector<at::Device>& devices) {
  std::vector<Row> rows;
  for (const auto& dev : devices) {
    for (const auto& dt : o.dtypes) {
      for (const auto& [sq, skv] : o.shapes) {
        for (int64_t h : o.heads) {
          for (int64_t hkv : o.hkv) {
            if (hkv <= 0 || h % hkv != 0) continue;
            for (int64_t d : o.dims) time_config(rows, o, dev, dt, sq, skv, h, hkv, d);
          }
        }
      }
    }
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    lvx::cli::ArgParser args("bench_kernels [options]",
                             "Local attention kernels: correctness vs fp64, then speed vs "
                             "at::matmul (CPU) and SDPA flash/cuDNN (CUDA).");
    add_options(args);
    if (!args.parse(argc, argv)) return 0;
    const Options o = parse_options(args);
    int failed_devices = 0;
    const std::vector<at::Device> devices = checked_devices(o, failed_devices);
    if (o.check_only) return failed_devices == 0 ? 0 : 1;
    if (o.demo) memory_demo();
    const std::vector<Row> rows = time_all(o, devices);
    if (const std::string bad = implausible_rate(rows); !bad.empty()) {
      std::cerr << "bench_kernels: error: implausible timing: " << bad << "\n";
      return 1;
    }
    if (o.profile.empty()) print_rows(rows, o.format);
    if (failed_devices > 0) return 1;
  } catch (const std::exception& e) {
    std::cerr << "bench_kernels: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
