// The GEMM-based blockwise path (kernels/attention_gemm.h, CUDA's route for bf16/fp16/fp32)
// checked here on CPU, where its GEMMs run in fp32: against the kernels run in float64 (which
// test_kernels.cpp checks against an independent dense reference), with the dual gate error ≤
// 2 × error of the same-dtype CPU kernel + atol. One case is large enough to span several key
// chunks, so the rescaling between chunks is exercised too.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>

#include "kernels/attention.h"
#include "kernels/attention_gemm.h"
#include "kernels/cpu_path.h"

namespace lvx::kernels {
namespace {

double err(const at::Tensor& a, const at::Tensor& b) {
  auto x = a.to(at::kDouble), y = b.to(at::kDouble);
  auto d = (x - y).abs().masked_fill(x.isinf() & y.isinf() & x.eq(y), 0.0);
  return d.numel() ? d.max().item<double>() : 0.0;
}

struct GemmCase {
  const char* name;
  MaskKind kind;
  MediaRule rule;
  bool padding;
  int64_t hq, hkv, sq, skv;
  at::ScalarType dtype;
  bool sees_all = false;  // AttentionMask::unmatched_sees_all
};

void PrintTo(const GemmCase& c, std::ostream* os) { *os << c.name; }

class AttentionGemm : public ::testing::TestWithParam<GemmCase> {};

TEST_P(AttentionGemm, ForwardBackwardMatchFloat64) {
  const GemmCase c = GetParam();
  const int64_t B = 2, D = 16;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  auto q = at::randn({B, c.sq, c.hq, D}, gen, at::kDouble);
  auto k = at::randn({B, c.skv, c.hkv, D}, gen, at::kDouble);
  auto v = at::randn({B, c.skv, c.hkv, D}, gen, at::kDouble);
  auto dout = at::randn({B, c.sq, c.hq, D}, gen, at::kDouble);
  AttentionParams p;
  p.mask.kind = c.kind;
  p.mask.media_rule = c.rule;
  p.mask.unmatched_sees_all = c.sees_all;
  if (c.kind == MaskKind::kCausal) {
    p.mask.q_pos = at::arange(c.sq) + (c.skv - c.sq);
    p.mask.k_pos = at::arange(c.skv);
  } else if (c.kind == MaskKind::kMedia) {
    p.mask.q_media = (at::div(at::arange(c.sq) * 3, c.sq, "floor") - 1).to(at::kInt).repeat({B, 1});
    p.mask.kv_media = at::div(at::arange(c.skv) * 2, c.skv, "floor").to(at::kInt).repeat({B, 1});
  }
  if (c.padding) p.mask.kv_valid = (at::arange(c.skv) < c.skv - 3).repeat({B, 1});
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  // float64 reference (the kernels in fp64) and the same-dtype CPU kernel.
  auto ref = attention_forward(q, k, v, p);
  auto ref_g = attention_backward(q, k, v, dout, ref.lse, attention_delta(dout, ref.o), p);
  auto qd = q.to(c.dtype), kd = k.to(c.dtype), vd = v.to(c.dtype), dod = dout.to(c.dtype);
  auto same = attention_forward(qd, kd, vd, p);
  auto same_g = attention_backward(qd, kd, vd, dod, same.lse, attention_delta(dod, same.o), p);
  AttentionStats stats;
  auto got = attention_forward_gemm(qd, kd, vd, scale, p.mask, &stats);
  auto got_g = attention_backward_gemm(qd, kd, vd, dod, got.lse, attention_delta(dod, got.o), scale,
                                       p.mask, nullptr);
  const double atol = c.dtype == at::kFloat ? 2e-5 : 1e-3;  // as in test_kernels.cpp
  auto gate = [&](const char* what, const at::Tensor& g, const at::Tensor& r, const at::Tensor& s) {
    EXPECT_LE(err(g, r), 2 * err(s, r) + atol) << what << " (same-dtype error " << err(s, r) << ")";
    EXPECT_FALSE(g.isnan().any().item<bool>()) << what;
  };
  gate("o", got.o.to(c.dtype), ref.o, same.o.to(c.dtype));
  gate("lse", got.lse, ref.lse, same.lse);
  gate("dq", got_g.dq.to(c.dtype), ref_g.dq, same_g.dq.to(c.dtype));
  gate("dk", got_g.dk.to(c.dtype), ref_g.dk, same_g.dk.to(c.dtype));
  gate("dv", got_g.dv.to(c.dtype), ref_g.dv, same_g.dv.to(c.dtype));
  EXPECT_GE(stats.tiles_total, 1);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, AttentionGemm,
    ::testing::Values(
        GemmCase{"none_mha_f32", MaskKind::kNone, MediaRule::kImmediate, false, 4, 4, 9, 33,
                 at::kFloat},
        GemmCase{"none_gqa_bf16", MaskKind::kNone, MediaRule::kImmediate, false, 4, 2, 9, 33,
                 at::kBFloat16},
        GemmCase{"causal_gqa_f32", MaskKind::kCausal, MediaRule::kImmediate, false, 4, 2, 17, 40,
                 at::kFloat},
        GemmCase{"causal_mqa_bf16", MaskKind::kCausal, MediaRule::kImmediate, false, 4, 1, 17, 40,
                 at::kBFloat16},
        GemmCase{"media_immediate_f32", MaskKind::kMedia, MediaRule::kImmediate, false, 4, 2, 12,
                 30, at::kFloat},
        GemmCase{"media_upto_bf16", MaskKind::kMedia, MediaRule::kUpTo, false, 4, 4, 12, 30,
                 at::kBFloat16},
        GemmCase{"media_sees_all_padding_f32", MaskKind::kMedia, MediaRule::kImmediate, true, 4,
                 2, 12, 30, at::kFloat, true},
        GemmCase{"padding_f32", MaskKind::kNone, MediaRule::kImmediate, true, 2, 1, 5, 21,
                 at::kFloat},
        GemmCase{"decode_sq1_bf16", MaskKind::kNone, MediaRule::kImmediate, false, 8, 2, 1, 300,
                 at::kBFloat16},
        // B·Hq·Sq = 2·8·2048 rows: the 256 MiB score budget gives 2048-key chunks, so 2500
        // keys take two chunks and exercise the online-softmax rescaling between them.
        GemmCase{"two_chunks_causal_f32", MaskKind::kCausal, MediaRule::kImmediate, false, 8, 8,
                 2048, 2500, at::kFloat}),
    [](const auto& info) { return std::string(info.param.name); });

// Which key chunks run is planned on the host from the mask metadata, once per call (no device
// wait per chunk): 2·8·2048 query rows give 2048-key chunks, so 6144 keys are three chunks. With
// causal positions 0..2047 (top-left aligned) only the first chunk has a visible key: the other
// two must be skipped, and the result must still equal the float64 kernels'. Media-up-to with
// every key in media 0 makes every chunk fully visible (no mask built).
TEST(AttentionGemmPlan, InvisibleChunksAreSkippedAndFullOnesBuildNoMask) {
  const int64_t B = 2, H = 8, D = 16, sq = 2048, skv = 6144;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  auto q = at::randn({B, sq, H, D}, gen, at::kFloat),
       k = at::randn({B, skv, H, D}, gen, at::kFloat);
  auto v = at::randn({B, skv, H, D}, gen, at::kFloat),
       dout = at::randn({B, sq, H, D}, gen, at::kFloat);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  AttentionParams p;
  p.mask.kind = MaskKind::kCausal;
  p.mask.q_pos = at::arange(sq);
  p.mask.k_pos = at::arange(skv);
  AttentionStats stats;
  auto got = attention_forward_gemm(q, k, v, scale, p.mask, &stats);
  EXPECT_EQ(stats.tiles_total, 3);
  EXPECT_EQ(stats.tiles_skipped, 2);
  EXPECT_EQ(stats.tiles_full, 0);
  auto ref = attention_forward(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble), p);
  EXPECT_LE(err(got.o, ref.o), 2e-5);
  EXPECT_LE(err(got.lse, ref.lse), 2e-5);
  AttentionStats bstats;
  auto got_g = attention_backward_gemm(q, k, v, dout, got.lse, attention_delta(dout, got.o), scale,
                                       p.mask, &bstats);
  EXPECT_EQ(bstats.tiles_skipped, 2);
  auto ref_g = attention_backward(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble),
                                  dout.to(at::kDouble), ref.lse,
                                  attention_delta(dout.to(at::kDouble), ref.o), p);
  EXPECT_LE(err(got_g.dq, ref_g.dq), 1e-4);
  EXPECT_LE(err(got_g.dk.narrow(1, 0, sq), ref_g.dk.narrow(1, 0, sq)), 1e-4);
  EXPECT_EQ(got_g.dk.narrow(1, sq, skv - sq).abs().max().item<float>(), 0.0f);  // never seen

  AttentionParams m;
  m.mask.kind = MaskKind::kMedia;
  m.mask.media_rule = MediaRule::kUpTo;
  m.mask.q_media = at::zeros({B, sq}, at::kInt);
  m.mask.kv_media = at::zeros({B, skv}, at::kInt);
  AttentionStats mstats;
  auto full = attention_forward_gemm(q, k, v, scale, m.mask, &mstats);
  EXPECT_EQ(mstats.tiles_total, 3);
  EXPECT_EQ(mstats.tiles_full, 3);
  auto unmasked = attention_forward_gemm(q, k, v, scale, AttentionMask{}, nullptr);
  EXPECT_EQ(err(full.o, unmasked.o), 0.0);
}

}  // namespace
}  // namespace lvx::kernels

// The CPU path per block shape (kernels/cpu_path.h): the choice measured at the nearest aspect
// ratio (log scale) serves a block, and a GEMM-path block equals the fused path's to fp32
// rounding (the same attention, another order of summation).
TEST(CpuAttentionPath, NearestMeasuredRatioServesTheBlock) {
  using lvx::kernels::CpuPath;
  if (std::getenv("LVX_CPU_ATTENTION")) GTEST_SKIP() << "LVX_CPU_ATTENTION overrides the choice";
  EXPECT_EQ(lvx::kernels::cpu_attention_path(at::kFloat, 100, 10000), CpuPath::kFused);
  lvx::kernels::set_cpu_attention_choices({{1, CpuPath::kFused}, {64, CpuPath::kGemm}});
  EXPECT_EQ(lvx::kernels::cpu_attention_path(at::kFloat, 1000, 1000), CpuPath::kFused);
  EXPECT_EQ(lvx::kernels::cpu_attention_path(at::kFloat, 100, 1000), CpuPath::kGemm);  // 10: 64
  EXPECT_EQ(lvx::kernels::cpu_attention_path(at::kFloat, 1000, 300), CpuPath::kFused);
  EXPECT_EQ(lvx::kernels::cpu_attention_path(at::kDouble, 100, 10000), CpuPath::kKernel);
  at::manual_seed(3);
  const at::Tensor q = at::randn({1, 16, 2, 8}), k = at::randn({1, 256, 2, 8});
  const at::Tensor v = at::randn({1, 256, 2, 8});
  const lvx::kernels::AttentionParams params;
  const auto gemm = lvx::kernels::attention_forward(q, k, v, params);  // ratio 16: gemm
  lvx::kernels::set_cpu_attention_choices({});
  const auto fused = lvx::kernels::attention_forward(q, k, v, params);
  EXPECT_LT((gemm.o - fused.o).abs().max().item<double>(), 1e-5);
  EXPECT_LT((gemm.lse - fused.lse).abs().max().item<double>(), 1e-5);
}

