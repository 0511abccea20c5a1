// OpenFlamingo conformance: tiny random OpenFlamingo models built with the real open-flamingo
// 2.0.1 package (a tiny open_clip ViT, the package's Perceiver resampler and gated
// cross-attention, and transformers' GPT-NeoX, MPT or Llama (GQA)), saved as a release is saved and
// converted by models/openflamingo/convert_openflamingo.py; expected logits, loss and gradients
// from the package's own forward in float64 (tests/reference/openflamingo_ref.py). `lvx forward`
// must match at world sizes 1–4 for every strategy kind. Tolerance (fp32): logits and loss within
// 1e-4 absolute (measured ≈3e-6), gradients within 1e-4 of their largest element (measured ≈3e-6).
// Generation: greedy tokens through lvx's KV cache and pass-Q decode steps equal the package's
// greedy loop without a cache (OpenFlamingoGeneration).
#include <gtest/gtest.h>

#include <fstream>
#include <map>

#include "models/checkpoint.h"
#include "models/model.h"
#include "models/openflamingo/model.h"
#include "src/common/safetensors.h"
#include "src/dist/process_group.h"
#include "tests/build_paths.h"
#include "tests/model_conformance.h"
#include "tests/model_extend.h"
#include "tests/model_rows.h"

namespace {

using namespace lvx::testing;
namespace fs = std::filesystem;

// "gpt_neox-variant": partial rotary, parallel residual, ViT tokens before ln_post.
std::string ref_script() {
  return lvx::testing::source_dir() + "/tests/reference/openflamingo_ref.py";
}

// The stamp of every generated reference: the script, the converter and the pinned packages.
std::string ref_stamp() {
  return script_stamp(ref_script()) +
         read_text(lvx::testing::source_dir() + "/models/openflamingo/convert_openflamingo.py");
}

const Reference& reference(const std::string& lm) {
  static std::map<std::string, Reference> made;
  auto it = made.find(lm);
  if (it != made.end()) return it->second;
  const std::string script = ref_script();
  const bool variant = lm == "gpt_neox-variant";
  return made[lm] = reference_model(
             "openflamingo_" + lm, script, ref_stamp(),
             "--lm " + (variant ? std::string("gpt_neox --rotary-pct 0.25 --parallel-residual "
                                              "--tokens-ln-post false")
                                : lm),
             "");
}

struct Case {
  std::string lm;
  int nproc;
  std::string strategies;
  std::string flags;  // --remat (DistFlashAttn §3.3)
};

// Readable parameters in test logs (not a byte dump).
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.lm << " on " << c.nproc << " ranks, " << c.strategies << " " << c.flags;
}

class OpenFlamingoConformance : public ::testing::TestWithParam<Case> {};

TEST_P(OpenFlamingoConformance, MatchesThePackage) {
  const Case& c = GetParam();
  expect_conforms(forward_against(reference(c.lm), "of_" + c.lm, c.nproc, c.strategies, c.flags),
                  1e-4, 1e-4, 60);
}

INSTANTIATE_TEST_SUITE_P(Cases, OpenFlamingoConformance,
                         ::testing::Values(Case{"gpt_neox", 1, "lv_xattn,ring", ""},
                                           Case{"gpt_neox", 2, "ring,ulysses", "--remat"},
                                           Case{"gpt_neox", 3, "lv_xattn,striped", ""},
                                           Case{"gpt_neox-variant", 2, "lv_xattn,ring", "--remat"},
                                           Case{"mpt", 1, "lv_xattn,ring", ""},
                                           Case{"mpt", 2, "all_gather,lv_xattn+ring", "--remat"},
                                           Case{"mpt", 4, "lv_xattn,striped", ""},
                                           Case{"llama", 1, "lv_xattn,ring", ""},
                                           Case{"llama", 2, "ulysses,striped", "--remat"},
                                           Case{"llama", 3, "lv_xattn,ring", ""}),
                         [](const auto& info) {
                           return test_name(
                               info.param.lm + "_n" + std::to_string(info.param.nproc) + "_" +
                               info.param.strategies + (info.param.flags.empty() ? "" : "_remat"));
                         });

// Greedy generation (prefill, then pass-Q decode steps through each rank's KV cache) equals the
// package's greedy loop without a cache (the whole fp64 Flamingo forward again for every token;
// a generated token sees its sample's last image in both), token for token, for each LM (GPT-NeoX
// with full and with partial rotary + parallel residual, MPT with its ALiBi channel, Llama with
// GQA) at 1–4 ranks; every step's logits within 1e-4 (measured ≈2e-6). Each decode step sends
// exactly what its merges send, computed here from the model's shapes: per merge_across_ranks of
// one partial [B, H, D], (n−1)·B·H·(D+1)·4 bytes; per decoder layer one self merge (H = heads,
// D = head_dim, MPT head_dim + 1 with the ALiBi channel) and, before it where the layer has a
// gated block, one cross merge (H = x_heads, D = x_dim_head).
struct GenCase {
  std::string lm;
  int nproc;
  std::string strategies;
  std::string flags = "";  // e.g. --decode-ranks all (default: rank 0 decodes alone)
};

void PrintTo(const GenCase& c, std::ostream* os) {
  *os << c.lm << " on " << c.nproc << " ranks, " << c.strategies;
}

class OpenFlamingoGeneration : public ::testing::TestWithParam<GenCase> {};

TEST_P(OpenFlamingoGeneration, GreedyTokensEqualThePackageLoop) {
  const GenCase& c = GetParam();
  const Reference& ref = reference(c.lm);
  const auto meta = generate_against(ref, "openflamingo_generate_" + c.lm, ref_script(),
                                     ref_stamp(), c.nproc, c.strategies, 6, c.flags);
  ASSERT_FALSE(meta.empty());

  const lvx::models::OpenFlamingoConfig cfg = lvx::models::openflamingo_config(
      lvx::models::load_checkpoint(ref.model).config, ref.model + "/config.json");
  const int64_t B = lvx::load_safetensors(ref.batch).tensors.at("input_ids").size(0);
  auto merge_bytes = [&](int64_t heads, int64_t head_dim) {
    return int64_t{c.nproc - 1} * B * heads * (head_dim + 1) * 4;
  };
  // Every rank decoding: a pass-Q message per attention; rank 0 alone (the default): the cross
  // layers' queries only (the partials come back to it).
  const bool all = c.flags.find("--decode-ranks all") != std::string::npos || c.nproc == 1;
  int64_t formula = 0;
  for (int64_t i = 0; i < cfg.layers; ++i) {
    if (!all) {
      if (cfg.is_cross(i)) formula += lead_cross_bytes(c.nproc, B, cfg.x_heads, cfg.x_dim_head);
      continue;
    }
    if (cfg.is_cross(i)) formula += merge_bytes(cfg.x_heads, cfg.x_dim_head);
    formula += merge_bytes(cfg.heads, cfg.head_dim + (cfg.lm == "mpt" ? 1 : 0));
  }
  EXPECT_EQ(std::stoll(meta.at("decode_bytes_sent_per_token")), formula) << "formula " << formula;
}

INSTANTIATE_TEST_SUITE_P(Cases, OpenFlamingoGeneration,
                         ::testing::Values(GenCase{"gpt_neox", 1, "lv_xattn,ring"},
                                           GenCase{"gpt_neox", 3, "lv_xattn,striped"},
                                           GenCase{"gpt_neox-variant", 2, "all_gather,ring",
                                                   "--decode-ranks all"},
                                           GenCase{"mpt", 2, "lv_xattn,striped",
                                                   "--decode-ranks all"},
                                           GenCase{"llama", 4, "all_gather,striped"}),
                         [](const auto& info) {
                           return test_name(info.param.lm + "_n" +
                                            std::to_string(info.param.nproc) + "_" +
                                            info.param.strategies + info.param.flags);
                         });

// Model::extend (follow-up questions about a kept prompt, lvx serve): the prompt up to its last
// `<image>` as a prefill, then the rest in one extend, equals the whole prompt's prefill and the
// rest as decode steps (tests/model_extend.h), for each decoder kind: GPT-NeoX (rotary, both
// residual layouts), MPT (ALiBi as an extra channel) and Llama (GQA). fp32 within 1e-5 (the same
// sums in another order; a wrong position, image or merge moves them by far more). 3 text tokens
// are appended so that every row ends in text after its last image.
ExtendDiff of_extend(const std::string& lm, std::shared_ptr<lvx::dist::ProcessGroup> pg) {
  const Reference& ref = reference(lm);
  const auto batch = lvx::load_safetensors(ref.batch).tensors;
  const auto model = lvx::models::load_model(ref.model, at::kFloat);
  EXPECT_TRUE(model->can_extend());
  const at::Tensor ids = with_text_tail(batch.at("input_ids"));
  const ExtendDiff d = extend_against_prefill(*model, ids, batch.at("pixel_values"), pg);
  std::cout << lm << ": split " << d.split << " of " << d.length << ", |extend − whole| " << d.whole
            << ", |extend − decode steps| " << d.steps << ", next step " << d.next << "\n";
  return d;
}

const std::vector<std::string> kExtendLms{"gpt_neox", "gpt_neox-variant", "mpt", "llama"};

// Chunked prefill (lvx serve's --max-batch-tokens, tests/model_extend.h): the prefix in chunks of
// 1 and 3 tokens, each token seeing its most recent image only (none before the first), sealed,
// then the question: the largest |Δ logits| against the whole prefill over both chunk sizes.
double of_chunked(const std::string& lm, std::shared_ptr<lvx::dist::ProcessGroup> pg) {
  const Reference& ref = reference(lm);
  const double worst = worst_chunked(ref.model, ref.batch, {1, 3}, pg);
  std::cout << lm << ": |chunked − whole| " << worst << "\n";
  return worst;
}

// Both within 1e-5 (fp32) for every decoder kind; on 3 ranks below.
TEST(OpenFlamingoChunkedPrefill, ChunksEqualTheWholePrefill) {
  for (const std::string& lm : kExtendLms) EXPECT_LE(of_chunked(lm, nullptr), 1e-5) << lm;
}

TEST(OpenFlamingoExtend, PrefixPrefillAndExtendEqualTheWholePrefill) {
  for (const std::string& lm : kExtendLms) {
    const ExtendDiff d = of_extend(lm, nullptr);
    EXPECT_LE(d.whole, 1e-5) << lm;
    EXPECT_LE(d.steps, 1e-5) << lm;
    EXPECT_LE(d.next, 1e-5) << lm;
  }
}

// Model::decode_rows (continuous batching): three generations about the same images at different
// lengths and one without images (its gated blocks skipped), each prefilled alone, stepped
// together: every row's logits equal its own decode_step's within 1e-5 (fp32), for each decoder
// kind; one row alone is decode_step bit for bit (tests/model_rows.h). Then three prompts of one
// length, whose prompt keys join the rows' own keys' product (prompt_front): the same bound.
TEST(OpenFlamingoDecodeRows, RowsAtTheirOwnLengthsEqualEachAlone) {
  for (const std::string& lm : kExtendLms) {
    const Reference& ref = reference(lm);
    const auto batch = lvx::load_safetensors(ref.batch).tensors;
    const auto model = lvx::models::load_model(ref.model, at::kFloat);
    ASSERT_TRUE(model->batches_rows());
    const at::Tensor ids = batch.at("input_ids");
    // Row 0's images: the batch's pixel_values are [B, images, frames, 3, S, S] or flat.
    const at::Tensor row0 = ids.narrow(0, 0, 1);
    const int64_t images = row0.eq(model->media_token_id()).sum().item<int64_t>();
    const at::Tensor px = batch.at("pixel_values");
    const at::Tensor pixels = px.dim() == 6 ? px.narrow(0, 0, 1) : px.narrow(0, 0, images);
    const RowsDiff d = decode_rows_against_steps(
        *model, row0, pixels, at::tensor({7, 8, 9, 10}, at::kLong).view({1, -1}));
    std::cout << lm << ": |rows together - each alone| " << d.worst << "\n";
    EXPECT_LE(d.worst, 1e-5) << lm;
    EXPECT_TRUE(d.lengths_equal) << lm;
    EXPECT_TRUE(d.one_row_bitwise) << lm;
    EXPECT_FALSE(d.fronted) << lm;  // prompts of three lengths: a call over each
    const RowsDiff one = decode_rows_against_steps(*model, row0, pixels, {}, /*one_length=*/true);
    std::cout << lm << ": one prompt length: |rows together - each alone| " << one.worst << "\n";
    EXPECT_LE(one.worst, 1e-5) << lm;
    EXPECT_TRUE(one.fronted) << lm;
  }
}

// The same on 3 ranks: the prompt's K/V and the images spread over the ranks, the tail's queries
// sent to them (pass-Q) and merged; a prefix prefilled in chunks sealed into 3 prompt shards.
LVX_WORKER(of_extend_ranks) {
  const auto pg = lvx::dist::ProcessGroup::from_env();
  for (const std::string& lm : kExtendLms) {
    const ExtendDiff d = of_extend(lm, pg);
    if (!(d.whole <= 1e-5 && d.steps <= 1e-5 && d.next <= 1e-5)) return 1;
    if (!(of_chunked(lm, pg) <= 1e-5)) return 1;  // chunks sealed into 3 prompt shards
  }
  return 0;
}

TEST(OpenFlamingoExtend, OnThreeRanksEqualsTheWholePrefill) {
  for (const std::string& lm : kExtendLms) reference(lm);  // made once, before the ranks read it
  expect_all_ok(run_ranks(3, "of_extend_ranks"));
}

// MPT in bf16 at long positions (issue 19): the ALiBi bias slope·j/scale rides in the keys' extra
// channels. Stored in ONE bf16 channel it kept 8 significant bits, so at position 2047 the bias
// of the keys near the query was off by several units and the logits of the last tokens went
// wrong while the first were right. With the bias split hi + mid + lo over three bf16 channels
// (alibi_channels), bf16 keeps fp32's bias. Text only (no images: the gated blocks do not run),
// one rank, 2048 random tokens, on the tiny MPT of the conformance tests. Two references:
// - the same model in fp32 (which matches the package within 1e-4, above): the bf16 error is as
//   small at positions 1984–2047 as at 0–63 (measured 0.048 and 0.058; one channel: 1.74);
// - the package's own language model (transformers' MptForCausalLM, which open-flamingo wraps,
//   with max_seq_len raised to 2048) in bf16 and fp32: lvx in bf16 is no further from the fp32
//   package than the package's bf16 is (measured 0.048 and 0.056).
std::string alibi_package_script() {
  return R"PY(
import json, sys, torch
from safetensors.torch import load_file, save_file
from transformers import MptConfig, MptForCausalLM
d, batch, out = sys.argv[1:4]
c = json.load(open(d + "/config.json"))
ids = load_file(batch)["input_ids"]
tc = {k: v for k, v in c["text_config"].items() if k not in ("architectures", "transformers_version", "dtype", "torch_dtype")}
tc["max_seq_len"], tc["vocab_size"] = ids.shape[1], c["vocab_size"]
sd = {k[len("lang_encoder."):].replace("decoder_layer.", ""): v
      for k, v in load_file(d + "/model.safetensors").items()
      if k.startswith("lang_encoder.transformer.") and "gated_cross_attn" not in k}
res = {}
for name, dt in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    m = MptForCausalLM(MptConfig(**tc))
    missing, unexpected = m.load_state_dict(sd, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    with torch.no_grad():
        res[name] = m.to(dt).eval()(ids).logits.float().contiguous()
save_file(res, out)
)PY";
}

TEST(OpenFlamingoBf16, AlibiKeepsItsPrecisionAtLongPositions) {
  const Reference& ref = reference("mpt");
  lvx::models::Parallel par;
  par.pg = lvx::dist::ProcessGroup::from_env();
  const auto fp32 = lvx::models::load_model(ref.model, at::kFloat);
  const auto bf16 = lvx::models::load_model(ref.model, at::kBFloat16);
  const int64_t L = 2048, media = fp32->media_token_id();
  at::manual_seed(0);
  at::Tensor ids = at::randint(0, 300, {1, L}, at::kLong);
  ids = at::where(ids == media, at::zeros_like(ids), ids);
  lvx::models::ModelInputs in;
  in.input_ids = ids;
  in.pixel_values = at::zeros({0, 3, 32, 32});
  const at::Tensor want = fp32->forward(in, par).logits.to(at::kFloat);
  const at::Tensor got = bf16->forward(in, par).logits.to(at::kFloat);
  EXPECT_TRUE(at::isfinite(got).all().item<bool>());
  // The worst logit error of the first and of the last 64 positions.
  auto errors = [&](const at::Tensor& a, const at::Tensor& b) {
    const at::Tensor e = (a - b).abs().amax(-1).squeeze(0);  // [L]
    return std::make_pair(e.slice(0, 0, 64).max().item<double>(),
                          e.slice(0, L - 64).max().item<double>());
  };
  const auto [early, late] = errors(got, want);
  const double scale = want.abs().max().item<double>();
  std::cout << "lvx bf16 vs lvx fp32: positions 0-63 " << early << ", " << L - 64 << "-" << L - 1
            << " " << late << " (largest logit " << scale << ")\n";
  EXPECT_LT(late, 3 * early + 0.02 * scale) << "the bf16 error grows with the position";

  const fs::path dir = lvx::testing::workdir() / "alibi_bf16";
  fs::create_directories(dir);
  const std::string batch = (dir / "batch.safetensors").string(),
                    script = (dir / "mpt.py").string(),
                    out = (dir / "package.safetensors").string();
  lvx::save_safetensors(batch, {{"input_ids", ids}});
  std::ofstream(script) << alibi_package_script();
  const std::string log = lvx::testing::run_command(lvx::testing::python() + " " + script + " " +
                                                    ref.model + " " + batch + " " + out);
  ASSERT_EQ(log.find("[exit status"), std::string::npos) << log;
  const auto pkg = lvx::load_safetensors(out).tensors;
  const auto [fp32_early, fp32_late] = errors(want, pkg.at("fp32"));
  EXPECT_LT(std::max(fp32_early, fp32_late), 1e-3) << "lvx fp32 is not the package's MPT";
  const auto [pkg_early, pkg_late] = errors(pkg.at("bf16"), pkg.at("fp32"));
  const auto [lvx_early, lvx_late] = errors(got, pkg.at("fp32"));
  std::cout << "against the package in fp32, positions " << L - 64 << "-" << L - 1
            << ": package bf16 " << pkg_late << ", lvx bf16 " << lvx_late << "\n";
  EXPECT_LT(lvx_late, 2 * pkg_late + 0.01 * scale) << "lvx bf16 is worse than the package's bf16";
}

}  // namespace
