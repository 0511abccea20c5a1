// bench_kernels' correctness phase (benchmarks/kernel_checks.h): the same gate as
// tests/test_kernels.cpp, on any device.
#include "benchmarks/kernel_checks.h"

#include <algorithm>
#include <iostream>
#include <limits>
#include <tuple>
#include <vector>

#include "kernels/attention.h"
#include "src/common/dtype.h"

using namespace lvx::kernels;

namespace lvx::bench {
namespace {

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

}  // namespace

const char* mask_name(MaskCase m) {
  const char* names[] = {"none", "causal", "mediaImm", "mediaUpTo", "padding"};
  return names[static_cast<int>(m)];
}

std::string dtype_name(at::ScalarType t) { return t == at::kDouble ? "fp64" : lvx::dtype_name(t); }

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

}  // namespace lvx::bench
