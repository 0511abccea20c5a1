// Over 600 lines: the correctness sweep, the CPU and CUDA timings and the table share the case
// lists and the gate of one binary, the one the GPU archive ships; the profile is already apart
// (kernel_profile.cpp). Issue 33 splits the timing from the checks.
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
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "benchmarks/kernel_profile.h"
#include "kernels/attention.h"
#include "src/cli/args.h"
#include "src/common/device_sync.h"
#include "src/common/dtype.h"
#include "src/common/error.h"


using namespace lvx::kernels;

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

std::string dtype_name(at::ScalarType t) { return t == at::kDouble ? "fp64" : lvx::dtype_name(t); }

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
// Correctness: the same gate as tests/test_kernels.cpp, on any device.

enum class MaskCase { kNone, kCausal, kMediaImmediate, kMediaUpTo, kPadding };
const char* mask_name(MaskCase m) {
  const char* names[] = {"none", "causal", "mediaImm", "mediaUpTo", "padding"};
  return names[static_cast<int>(m)];
}

AttentionMask make_mask(MaskCase c, int64_t batch, int64_t sq, int64_t skv) {
  AttentionMask m;
  if (c == MaskCase::kCausal) {
    m.kind = MaskKind::kCausal;
    m.q_pos = at::arange(sq, at::kLong) + (skv - sq);
    m.k_pos = at::arange(skv, at::kLong);
  } else if (c == MaskCase::kMediaImmediate || c == MaskCase::kMediaUpTo) {
    m.kind = MaskKind::kMedia;
    m.media_rule = c == MaskCase::kMediaImmediate ? MediaRule::kImmediate : MediaRule::kUpTo;
    m.q_media = std::get<0>(at::randint(-1, 3, {batch, sq}, at::kInt).sort(1)).contiguous();
    m.kv_media = (at::arange(skv, at::kLong) * 3 / std::max<int64_t>(skv, 1))
                     .to(at::kInt)
                     .unsqueeze(0)
                     .repeat({batch, 1})
                     .contiguous();
    if (skv > 3) m.kv_media.select(1, skv / 3).fill_(-1);
  } else if (c == MaskCase::kPadding) {
    m.kv_valid = at::rand({batch, skv}) > 0.2;
  }
  return m;
}

AttentionMask mask_to(const AttentionMask& m, const at::Device& dev) {
  AttentionMask r = m;
  for (at::Tensor* t : {&r.q_pos, &r.k_pos, &r.q_media, &r.kv_media, &r.kv_valid}) {
    if (t->defined()) *t = t->to(dev);
  }
  return r;
}

double error(const at::Tensor& x, const at::Tensor& ref) {
  auto a = x.to(at::kCPU).to(at::kDouble), r = ref.to(at::kCPU).to(at::kDouble);
  if (a.isnan().any().item<bool>()) return std::numeric_limits<double>::infinity();
  auto both = a.isneginf() & r.isneginf();
  auto diff = at::where(both, at::zeros_like(a), a - r);
  if (!diff.isfinite().all().item<bool>()) return std::numeric_limits<double>::infinity();
  const double scale =
      std::max(1.0, at::where(both, at::zeros_like(r), r).abs().max().item<double>());
  return diff.abs().max().item<double>() / scale;
}

double gate_atol(at::ScalarType t) {
  return t == at::kDouble ? 1e-11 : t == at::kFloat ? 2e-5 : 1e-3;
}

struct Grads {
  at::Tensor dq, dk, dv;
};

Grads reference_grads(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& dout, const AttentionParams& p, at::ScalarType dtype) {
  auto qd = q.to(dtype).detach().requires_grad_(true);
  auto kd = k.to(dtype).detach().requires_grad_(true);
  auto vd = v.to(dtype).detach().requires_grad_(true);
  (attention_reference(qd, kd, vd, mask_matrix(p.mask, qd.size(0), qd.size(1), kd.size(1)), p.scale,
                       dtype)
       .o *
   dout.to(dtype))
      .sum()
      .backward();
  return {qd.grad(), kd.grad(), vd.grad()};
}

// Runs the kernel on `dev` and checks o, lse, dq, dk, dv against CPU fp64; returns failures.
int check_case(const at::Device& dev, at::ScalarType dtype, MaskCase mc, int64_t b, int64_t sq,
               int64_t skv, int64_t hq, int64_t hkv, int64_t d, bool verbose) {
  at::manual_seed(42);
  auto q = at::randn({b, sq, hq, d}).to(dtype), k = at::randn({b, skv, hkv, d}).to(dtype);
  auto v = at::randn({b, skv, hkv, d}).to(dtype), dout = at::randn({b, sq, hq, d}).to(dtype);
  AttentionParams p;
  p.mask = make_mask(mc, b, sq, skv);
  AttentionParams pd = p;
  pd.mask = mask_to(p.mask, dev);
  auto out = attention_forward(q.to(dev), k.to(dev), v.to(dev), pd);
  auto delta = attention_delta(dout.to(dev), out.o);
  auto g = attention_backward(q.to(dev), k.to(dev), v.to(dev), dout.to(dev), out.lse, delta, pd);
  // The same-dtype reference runs on CPU in fp32 for fp16 (CPU half matmul is emulated).
  const auto ref_dtype = dtype == at::kHalf ? at::kFloat : dtype;
  const at::Tensor visible = mask_matrix(p.mask, q.size(0), q.size(1), k.size(1));
  auto exact = attention_reference(q, k, v, visible, p.scale, at::kDouble);
  auto same = attention_reference(q, k, v, visible, p.scale, ref_dtype);
  auto gx = reference_grads(q, k, v, dout, p, at::kDouble);
  auto gs = reference_grads(q, k, v, dout, p, ref_dtype);
  const double atol = gate_atol(dtype);
  int fails = 0;
  auto gate = [&](const char* what, const at::Tensor& got, const at::Tensor& want,
                  const at::Tensor& same_ref) {
    const double e = error(got, want), e_ref = error(same_ref, want);
    const bool ok = e <= 2 * e_ref + atol;
    if (!ok || verbose) {
      std::cerr << (ok ? "  ok   " : "  FAIL ") << dev << " " << dtype_name(dtype) << " "
                << mask_name(mc) << " B" << b << " Sq" << sq << " Skv" << skv << " Hq" << hq
                << " Hkv" << hkv << " D" << d << " " << what << ": error " << e
                << " vs same-dtype reference " << e_ref << "\n";
    }
    fails += !ok;
  };
  gate("o", out.o, exact.o, same.o);
  gate("lse", out.lse, exact.lse, same.lse);
  gate("dq", g.dq, gx.dq, gs.dq);
  gate("dk", g.dk, gx.dk, gs.dk);
  gate("dv", g.dv, gx.dv, gs.dv);
  return fails;
}

// Split K/V into 3 blocks, run and merge on `dev`; compare with the unsplit forward.
int check_merge(const at::Device& dev) {
  at::manual_seed(5);
  const int64_t b = 2, sq = 50, skv = 5000, hq = 4, d = 64;
  auto q = at::randn({b, sq, hq, d}, dev), k = at::randn({b, skv, hq, d}, dev);
  auto v = at::randn({b, skv, hq, d}, dev);
  AttentionParams p;
  p.mask.kind = MaskKind::kCausal;
  p.mask.q_pos = (at::arange(sq, at::kLong) * 97 + 10).to(dev);
  p.mask.k_pos = at::arange(skv, at::kLong).to(dev);
  auto whole = attention_forward(q, k, v, p);
  auto o = at::zeros({b, sq, hq, d}, q.options());
  auto lse = at::full({b, hq, sq}, -std::numeric_limits<double>::infinity(), q.options());
  const int64_t cuts[] = {0, 1700, 3300, skv};
  for (int i = 0; i < 3; ++i) {
    AttentionParams pb = p;
    pb.mask.k_pos = p.mask.k_pos.narrow(0, cuts[i], cuts[i + 1] - cuts[i]);
    auto part = attention_forward(q, k.narrow(1, cuts[i], cuts[i + 1] - cuts[i]),
                                  v.narrow(1, cuts[i], cuts[i + 1] - cuts[i]), pb);
    merge_attention_states(o, lse, part.o, part.lse);
  }
  const double e = std::max(error(o, whole.o), error(lse, whole.lse));
  const bool ok = e <= 1e-5;
  std::cerr << (ok ? "  ok   " : "  FAIL ") << dev << " merge of 3 K/V blocks vs unsplit: error "
            << e << "\n";
  return !ok;
}

int run_checks(const at::Device& dev, bool verbose) {
  struct S {
    int64_t b, sq, skv, hq, hkv, d;
  };
  const std::vector<S> shapes = {{2, 1, 77, 4, 4, 32},
                                 {2, 37, 1100, 4, 2, 64},
                                 {1, 130, 130, 4, 1, 16},
                                 {2, 200, 70, 4, 2, 32},
                                 {1, 64, 5000, 2, 2, 128}};
  int fails = 0, cases = 0;
  {
    std::vector<at::ScalarType> dtypes = {at::kFloat, at::kBFloat16, at::kDouble};
    if (dev.is_cuda()) dtypes.push_back(at::kHalf);
    for (auto dt : dtypes) {
      for (auto mc : {MaskCase::kNone, MaskCase::kCausal, MaskCase::kMediaImmediate,
                      MaskCase::kMediaUpTo, MaskCase::kPadding}) {
        for (const auto& s : shapes) {
          if (!dev.is_cuda() && s.skv > 2000) continue;                  // keep the CPU check quick
          if (dev.is_cuda() && dt == at::kDouble && s.d > 64) continue;  // fp64 smem limit
          try {
            fails += check_case(dev, dt, mc, s.b, s.sq, s.skv, s.hq, s.hkv, s.d, verbose);
          } catch (const std::exception& e) {
            ++fails;
            std::cerr << "  FAIL " << dev << " " << dtype_name(dt) << " " << mask_name(mc) << " Sq"
                      << s.sq << " Skv" << s.skv << " D" << s.d << ": " << e.what() << "\n";
          }
          ++cases;
        }
      }
    }
    fails += check_merge(dev);
  }
  std::cerr << "correctness on " << dev << ": " << cases << " cases x (o, lse, dq, dk, dv) + "
            << "merge, " << fails << " failures\n";
  return fails;
}

// ---------------------------------------------------------------------------------------------
// Timing.

struct Row {
  std::string device, dtype, op;
  int64_t sq, skv, heads, hkv, dim;
  double seconds, rate, baseline_rate;  // rate in GFLOP/s (CPU) or TFLOP/s (CUDA); the
                                        // ratio rate / baseline_rate is baseline time / lvx time
  std::string baseline;
  double spread;
};

void print_rows(const std::vector<Row>& rows, const std::string& format) {
  if (format == "json") {
    for (const auto& r : rows) {
      std::cout << "{\"device\":\"" << r.device << "\",\"dtype\":\"" << r.dtype << "\",\"op\":\""
                << r.op << "\",\"sq\":" << r.sq << ",\"skv\":" << r.skv << ",\"heads\":" << r.heads
                << ",\"hkv\":" << r.hkv << ",\"dim\":" << r.dim
                << ",\"median_ms\":" << r.seconds * 1e3 << ",\"rate\":" << r.rate
                << ",\"baseline\":\"" << r.baseline << "\",\"baseline_rate\":" << r.baseline_rate
                << ",\"ratio\":" << (r.baseline_rate > 0 ? r.rate / r.baseline_rate : 0)
                << ",\"spread\":" << r.spread << "}\n";
    }
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

// A rate no device reaches means the clock did not wait for the device (a timer that reads it
// after the launches alone): the table is refused rather than printed. The bounds are several
// times today's peaks (an H200's dense bf16 is ~1 PFLOP/s, a B200's ~2.3; a CPU's few TFLOP/s).
constexpr double kCudaTflopsBound = 5000, kCpuGflopsBound = 200000;

// Names the first row whose lvx or baseline rate exceeds its device's bound; empty when none.
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

}  // namespace

int main(int argc, char** argv) {
  try {
    lvx::cli::ArgParser args("bench_kernels [options]",
                             "Local attention kernels: correctness vs fp64, then speed vs "
                             "at::matmul (CPU) and SDPA flash/cuDNN (CUDA).");
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
    if (!args.parse(argc, argv)) return 0;
    const std::string format = args.get("output");
    const int reps = static_cast<int>(args.get_int("reps"));
    const int warmup = static_cast<int>(args.get_int("warmup"));
    const bool check_only = args.flag("check-only"), demo = args.flag("memory-demo");
    const bool verbose = args.flag("verbose");
    const std::string device_s = args.get("device");
    const auto hkv_list = args.get_int_list("hkv");
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
    std::vector<MaskCase> masks;
    for (const auto& m : split(args.get("masks"))) {
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
    const auto heads_list = args.get_int_list("heads"), dim_list = args.get_int_list("dim");
    const auto dtype_list = args.get_list("dtype");
    LVX_CHECK(format == "md" || format == "json", "-o: expected md or json, got '", format, "'");
    std::vector<at::Device> devices;
    for (const auto& d : split(device_s)) {
      LVX_CHECK(d == "cpu" || d == "cuda", "--device: expected cpu or cuda, got '", d, "'");
      if (d == "cuda") {
        LVX_CHECK(cuda_present(), "--device cuda: no CUDA device (or built without CUDA)");
        devices.emplace_back(at::kCUDA, 0);
      } else {
        devices.emplace_back(at::kCPU);
      }
    }
    // Correctness first: a device whose kernels fail the check is not timed.
    std::vector<at::Device> checked;
    int failed_devices = 0;
    for (const auto& dev : devices) {
      if (run_checks(dev, verbose) == 0) {
        checked.push_back(dev);
      } else {
        ++failed_devices;
        std::cerr << "bench_kernels: correctness check failed on " << dev << "; not timing it\n";
      }
    }
    devices = checked;
    if (check_only) return failed_devices == 0 ? 0 : 1;
    if (demo) memory_demo();
    std::vector<Row> rows;
    for (const auto& dev : devices) {
      for (const auto& dt : dtype_list) {
        for (const auto& [sq, skv] : shapes) {
          for (int64_t h : heads_list) {
            for (int64_t hkv : hkv_list) {
              if (hkv <= 0 || h % hkv != 0) continue;
              for (int64_t d : dim_list) {
                std::cerr << "timing " << dev << " " << dt << " Sq=" << sq << " Skv=" << skv
                          << " H=" << h << " Hkv=" << hkv << " D=" << d << "\n";
                if (!args.get("profile").empty()) {
                  lvx::bench::profile_attention(args.get("profile"), dev, parse_dtype(dt), sq,
                                                skv, h, hkv, d, warmup, reps);
                } else if (dev.is_cuda()) {
#ifdef LVX_WITH_CUDA
                  bench_cuda(rows, sq, skv, h, hkv, d, parse_dtype(dt), warmup, reps);
#endif
                } else {
                  for (MaskCase mc : masks) {
                    bench_cpu(rows, mc, sq, skv, h, hkv, d, parse_dtype(dt), warmup, reps);
                  }
                }
              }
            }
          }
        }
      }
    }
    if (const std::string bad = implausible_rate(rows); !bad.empty()) {
      std::cerr << "bench_kernels: error: implausible timing: " << bad << "\n";
      return 1;
    }
    if (args.get("profile").empty()) print_rows(rows, format);
    if (failed_devices > 0) return 1;
  } catch (const std::exception& e) {
    std::cerr << "bench_kernels: error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
