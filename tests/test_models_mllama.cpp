// Llama-3.2-Vision (Mllama) conformance: a tiny random checkpoint saved by transformers'
// MllamaForConditionalGeneration.save_pretrained (the released layout) and the expected logits,
// loss and gradients of transformers itself in float64 (tests/reference/mllama_ref.py), on a
// batch as MllamaProcessor lays it out (pixel_values [B, images, tiles, 3, S, S],
// aspect_ratio_ids, aspect_ratio_mask, cross_attention_mask; text before the first image, so
// transformers' all-keys rows are exercised, a run of two consecutive images, a padding image).
// `lvx forward` must match it at world sizes 1–4 for lv_xattn and the baselines (ring,
// all_gather) on the cross layers and ring / striped / distflash on the self layers, with and
// without K/V recomputation and rematerialization. Tolerance (fp32 run vs fp64 reference):
// logits and loss within 1e-4 absolute (logits are O(1–10)), every gradient within 1e-4 of its
// largest element, as the other families' conformance tests.
//
// The mask pieces (models/mllama/mask.h) are checked against independent statements of the
// processor's and the model's rules first.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "models/mllama/mask.h"
#include "models/model.h"
#include "src/common/error.h"
#include "src/common/safetensors.h"
#include "src/dist/process_group.h"
#include "tests/build_paths.h"
#include "tests/model_conformance.h"
#include "tests/model_extend.h"
#include "tests/model_rows.h"
#include "tests/multirank.h"
#include "tests/reference_mask.h"

namespace {

using namespace lvx::testing;
namespace fs = std::filesystem;
namespace mllama = lvx::models::mllama;

std::string ref_script() { return lvx::testing::source_dir() + "/tests/reference/mllama_ref.py"; }

const Reference& reference() {
  static const Reference ref =
      reference_model("mllama", ref_script(), script_stamp(ref_script()), "", "--length 24");
  return ref;
}

constexpr int64_t kTokensPerTile = 17;  // the tiny model: 16 patches + the class token

// ---- the mask -----------------------------------------------------------------------------

// The visibility transformers' _prepare_cross_attention_mask gives (bias 0 = visible), written
// from its text: key j of image i, tile k is visible to row t iff mask[t, i, k] = 1, and a row
// whose mask is all 0 sees every key. bool [B, L, images · tiles · kTokensPerTile].
at::Tensor transformers_visibility(const at::Tensor& cam) {
  const int64_t B = cam.size(0), L = cam.size(1);
  at::Tensor units = cam.reshape({B, L, -1}).to(at::kBool);
  at::Tensor keys = units.repeat_interleave(kTokensPerTile, 2);
  at::Tensor blind = units.any(2).logical_not().unsqueeze(2);
  return keys | blind;
}

// Each row has keys in exactly one call, and the union of the calls is transformers' mask.
void expect_calls_reproduce(const at::Tensor& cam) {
  const mllama::CrossMask cm = mllama::cross_mask(cam, kTokensPerTile, "test");
  const int64_t B = cam.size(0), L = cam.size(1), S = cam.size(2) * cam.size(3) * kTokensPerTile;
  ASSERT_FALSE(cm.calls.empty());
  at::Tensor all = at::zeros({B, L, S}, at::kBool), rows_with_keys = at::zeros({B, L}, at::kLong);
  for (const auto& mm : cm.calls) {
    ASSERT_EQ(mm.kv_media.sizes(), at::IntArrayRef({B, S}));
    ASSERT_EQ(mm.slots * mm.tokens_per_media, S);
    const at::Tensor v = reference_visibility(mm.attention_mask(), B, L, S);
    all = all | v;
    rows_with_keys = rows_with_keys + v.any(2).to(at::kLong);
  }
  EXPECT_TRUE(all.equal(transformers_visibility(cam)));
  EXPECT_TRUE(rows_with_keys.eq(1).all().item<bool>()) << rows_with_keys;
  EXPECT_TRUE(cm.sees_media.equal(cam.reshape({B, L, -1}).ne(0).any(2)));
  EXPECT_TRUE(cm.last_row_keys.equal(transformers_visibility(cam).select(1, L - 1)));
}

TEST(MllamaMask, FromIdsEqualsTheProcessorsMask) {
  const auto batch = lvx::load_safetensors(reference().batch).tensors;
  const at::Tensor& cam = batch.at("cross_attention_mask");
  // The image token: the id input_ids holds where the processor's mask rows start.
  const std::string cfg = read_text(reference().model + "/config.json");
  const int64_t image = nlohmann::json::parse(cfg).at("image_token_index").get<int64_t>();
  const at::Tensor mine = mllama::cross_attention_mask_from_ids(
      batch.at("input_ids"), image, batch.at("aspect_ratio_mask").sum(-1), cam.size(3), "test");
  EXPECT_TRUE(mine.equal(cam.to(at::kLong))) << mine.sum() << " vs " << cam.sum();
}

TEST(MllamaMask, CallsReproduceTransformersBiasOnTheReferenceBatch) {
  const auto batch = lvx::load_safetensors(reference().batch).tensors;
  expect_calls_reproduce(batch.at("cross_attention_mask"));
  // A run of two images and a later one in sample 0: two families, two calls.
  EXPECT_EQ(mllama::cross_mask(batch.at("cross_attention_mask"), kTokensPerTile, "t").calls.size(),
            2u);
}

TEST(MllamaMask, CallsReproduceTransformersBiasOnProcessorLayouts) {
  // <|image|> = 9 in runs of 1–3, 4 images max, 2 tiles; the images' real tiles vary.
  const int64_t L = 30;
  at::Tensor ids = at::zeros({3, L}, at::kLong);
  for (int64_t p : {2, 3, 4, 15}) ids[0][p] = 9;    // a run of three, then one
  for (int64_t p : {0, 10, 11, 20}) ids[1][p] = 9;  // from the first token; a run of two
  for (int64_t p : {29}) ids[2][p] = 9;             // the last token only
  const at::Tensor tiles = at::tensor({1, 2, 1, 2, 2, 1, 2, 1, 1, 1, 1, 1}, at::kLong).view({3, 4});
  const at::Tensor cam = mllama::cross_attention_mask_from_ids(ids, 9, tiles, 2, "test");
  // The processor's rule, by hand: sample 0 image 1 covers [3, 15) on both tiles.
  EXPECT_EQ(cam[0].select(1, 1).sum(0).sum().item<int64_t>(), 12 * 2);
  EXPECT_EQ(cam[0][2].sum().item<int64_t>(), 1);   // token 2 sees image 0 only (tile 0)
  EXPECT_EQ(cam[0][3].sum().item<int64_t>(), 3);   // token 3: image 0 and both tiles of image 1
  EXPECT_EQ(cam[0][14].sum().item<int64_t>(), 4);  // the run's end: images 0, 1, 2
  EXPECT_EQ(cam[0][15].sum().item<int64_t>(), 2);  // image 3 only (two tiles)
  expect_calls_reproduce(cam);
}

TEST(MllamaMask, SetsThatAreNotNestedAreRefused) {
  at::Tensor cam = at::zeros({1, 3, 3, 1}, at::kLong);
  cam[0][0][0][0] = cam[0][0][1][0] = 1;  // row 0 sees images 0, 1
  cam[0][1][1][0] = cam[0][1][2][0] = 1;  // row 1 sees images 1, 2
  try {
    mllama::cross_mask(cam, kTokensPerTile, "batch.safetensors");
    FAIL() << "expected an error";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("overlap without one containing the other"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(mllama::cross_mask(at::ones({1, 3, 2, 1}, at::kFloat), 17, "x"), lvx::Error);
  EXPECT_THROW(mllama::cross_mask(at::full({1, 3, 2, 1}, 2, at::kLong), 17, "x"), lvx::Error);
}

// ---- lvx forward against transformers --------------------------------------------------------

struct Case {
  int nproc;
  std::string strategies;  // S_cross,S_self
  std::string flags;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.nproc << " ranks, " << c.strategies << " " << c.flags;
}

class MllamaConformance : public ::testing::TestWithParam<Case> {};

TEST_P(MllamaConformance, MatchesTransformers) {
  const Case& c = GetParam();
  const Diff d = forward_against(reference(), "mllama", c.nproc, c.strategies, c.flags);
  // Every tensor but the frozen vision model's: 5 layers (self 9, cross 13 tensors), the
  // embeddings, final norm, lm_head and the projector's weight and bias.
  expect_conforms(d, 1e-4, 1e-4, 3 * 9 + 2 * 13 + 5);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MllamaConformance,
    ::testing::Values(Case{1, "lv_xattn,ring", ""}, Case{2, "lv_xattn,ring", "--recompute"},
                      Case{2, "ring,striped", "--remat"}, Case{2, "all_gather,distflash", ""},
                      Case{3, "lv_xattn,distflash", ""},
                      Case{3, "lv_xattn+ring,ring", "--recompute --remat"},
                      Case{4, "lv_xattn,striped", ""}, Case{4, "ring,distflash", "--recompute"},
                      Case{4, "all_gather,ring", "--remat"},
                      // The planner's per-layer choice for this batch on a cluster config.
                      Case{3, "auto",
                           "--cluster " + lvx::testing::source_dir() +
                               "/configs/clusters/h100_80g_16.yaml --print-plan"}),
    [](const auto& info) {
      return "n" + std::to_string(info.param.nproc) + "_" + test_name(info.param.strategies) +
             test_name(info.param.flags.substr(0, info.param.flags.find(' ', 3)));
    });

// One sample with one image (the --one-image batch): from 2 ranks on, its tiles are encoded
// across the ranks (vision.h encode_tiles, then an all-to-all of the vision output to the rank
// that holds the image's keys) instead of the whole image on rank 0; logits, loss and gradients
// (the projector's included: it runs on that rank after the exchange) equal transformers'.
const Reference& one_image_reference() {
  static const Reference ref = reference_model(
      "mllama_one_image", ref_script(), script_stamp(ref_script()), "", "--length 24 --one-image");
  return ref;
}

class MllamaTilesAcrossRanks : public ::testing::TestWithParam<int> {};

TEST_P(MllamaTilesAcrossRanks, OneImageMatchesTransformers) {
  const int nproc = GetParam();
  const Diff d = forward_against(one_image_reference(), "mllama_one_image", nproc, "lv_xattn,ring",
                                 nproc == 3 ? "--recompute" : "");
  expect_conforms(d, 1e-4, 1e-4, 3 * 9 + 2 * 13 + 5);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, MllamaTilesAcrossRanks, ::testing::Values(1, 2, 3),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

// lvx qa / finetune's input: video frames [N, 3, S, S] and input_ids with <|image|> runs, nothing
// named. The same batch laid out as MllamaProcessor lays out one-tile images (tile 0 the frame,
// the other tiles zero; aspect ratio (1, 1); padding images zero with id 0; the mask from
// processing_mllama's own functions, made here in Python) through transformers must give lvx's
// logits, loss and gradients from the frames.
const Reference& frames_reference() {
  static const Reference ref = [] {
    const Reference& base = reference();
    std::string log;
    const std::string dir = generated(
        "mllama_frames", script_stamp(ref_script()) + "frames-v1 of " + base.batch,
        [&](const std::string& d) {
          auto batch = lvx::load_safetensors(base.batch).tensors;
          const at::Tensor& ids = batch.at("input_ids");
          const int64_t image =
              nlohmann::json::parse(read_text(base.model + "/config.json")).at("image_token_index");
          // Every image of the reference batch becomes a frame: tile 0 of its pixels, in order.
          std::vector<at::Tensor> frames;
          for (int64_t b = 0; b < ids.size(0); ++b)
            for (int64_t j = 0; j < ids[b].eq(image).sum().item<int64_t>(); ++j)
              frames.push_back(batch.at("pixel_values")[b][j][0]);
          lvx::save_safetensors(d + "/frames.safetensors",
                                {{"input_ids", ids},
                                 {"pixel_values", at::stack(frames).contiguous()},
                                 {"labels", batch.at("labels")}});
          const std::string py = d + "/to_processor.py";
          std::ofstream(py) << R"(import sys, torch
from safetensors.torch import load_file, save_file
from transformers.models.mllama.processing_mllama import (
    convert_sparse_cross_attention_mask_to_dense, get_cross_attention_token_mask)
f = load_file(sys.argv[1]); image = int(sys.argv[3]); tiles = 2
ids, frames = f["input_ids"], f["pixel_values"]
B, L = ids.shape
counts = [int((ids[b] == image).sum()) for b in range(B)]
n = max(counts)
pv = torch.zeros(B, n, tiles, *frames.shape[1:])
ar_ids = torch.zeros(B, n, dtype=torch.int64)
ar_mask = torch.zeros(B, n, tiles, dtype=torch.int64)
ar_mask[:, :, 0] = 1
k = 0
for b in range(B):
    for j in range(counts[b]):
        pv[b, j, 0] = frames[k]; ar_ids[b, j] = 1; k += 1
masks = [get_cross_attention_token_mask(ids[b].tolist(), image) for b in range(B)]
cam = torch.from_numpy(convert_sparse_cross_attention_mask_to_dense(
    masks, [[1] * c for c in counts], tiles, L))
save_file({"input_ids": ids, "pixel_values": pv, "aspect_ratio_ids": ar_ids,
           "aspect_ratio_mask": ar_mask, "cross_attention_mask": cam.contiguous(),
           "labels": f["labels"]}, sys.argv[2])
)";
          std::string out = run_command(python() + " " + py + " " + d + "/frames.safetensors " + d +
                                        "/processor.safetensors " + std::to_string(image));
          out += run_command(python() + " " + ref_script() + " run " + base.model + " " + d +
                             "/processor.safetensors " + d + "/expected.safetensors --backward");
          return out;
        },
        &log);
    EXPECT_FALSE(dir.empty()) << log;
    return Reference{base.model, dir + "/frames.safetensors", dir + "/expected.safetensors"};
  }();
  return ref;
}

class MllamaFrames : public ::testing::TestWithParam<int> {};

TEST_P(MllamaFrames, FramesAsOneTileImagesMatchTransformers) {
  const Diff d =
      forward_against(frames_reference(), "mllama_frames", GetParam(), "lv_xattn,ring", "");
  expect_conforms(d, 1e-4, 1e-4, 3 * 9 + 2 * 13 + 5);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, MllamaFrames, ::testing::Values(1, 3),
                         [](const auto& info) { return "n" + std::to_string(info.param); });

// Greedy generation (prefill, then pass-Q decode steps; a new token repeats the last row of the
// cross-attention mask, as transformers' generate) equals transformers' greedy loop without a
// cache, token for token; every step's logits within 1e-4. Each decode step sends the pass-Q
// formula's bytes (models/decode.h): (n−1)·A·B·Hq·(D+1)·4 per rank, A = 5 (one attention per
// layer), B = 2, Hq = 4, D = 16, with every rank decoding (--decode-ranks all); with rank 0 alone
// (the default, models/lead_decode.h) only the 2 cross layers' queries and partials.
class MllamaGeneration : public ::testing::TestWithParam<std::pair<int, bool>> {};

TEST_P(MllamaGeneration, GreedyTokensEqualTransformers) {
  const auto [n, all] = GetParam();
  const auto meta =
      generate_against(reference(), "mllama_generate", ref_script(), script_stamp(ref_script()), n,
                       "lv_xattn,ring", 6, all ? "--decode-ranks all" : "");
  ASSERT_FALSE(meta.empty());
  EXPECT_EQ(
      std::stoll(meta.at("decode_bytes_sent_per_token")),
      all || n == 1 ? int64_t{n - 1} * 5 * 2 * 4 * 17 * 4 : 2 * lead_cross_bytes(n, 2, 4, 16));
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, MllamaGeneration,
                         ::testing::Values(std::pair{1, false}, std::pair{2, true},
                                           std::pair{2, false}),
                         [](const auto& info) {
                           return "n" + std::to_string(info.param.first) +
                                  (info.param.second ? "_all" : "");
                         });

// `lvx plan --model <checkpoint dir>` reads config.json alone and plans the tiny model.
TEST(MllamaPlan, PlansTheCheckpoint) {
  const std::string out =
      run_command(lvx_binary() + " plan --model " + reference().model + " --cluster " +
                  lvx::testing::source_dir() +
                  "/configs/clusters/a100_80g_16.yaml --frames 8 --text 64 --nproc 4");
  EXPECT_EQ(out.find("exit status"), std::string::npos) << out;
  EXPECT_NE(out.find("lv_xattn"), std::string::npos) << out;
}

// freeze.policy cross_only on a loaded checkpoint: the whole cross layers (cross_attention_layers
// of config.json: attention, gates, norms, MLP) and the projector train; the self layers, the
// embeddings, lm_head and the vision tower do not. Checked against config.json's own list.
TEST(MllamaFreeze, CrossOnlyTrainsTheWholeCrossLayersAndTheProjector) {
  const std::unique_ptr<lvx::models::Model> model =
      lvx::models::load_model(reference().model, at::kFloat);
  const nlohmann::json cfg = nlohmann::json::parse(read_text(reference().model + "/config.json"));
  std::set<int64_t> cross;
  for (const auto& l : cfg.at("text_config").at("cross_attention_layers"))
    cross.insert(l.get<int64_t>());
  ASSERT_FALSE(cross.empty());
  size_t trained = 0, cross_mlp = 0;
  for (const auto& [name, t] : model->parameters()) {
    const std::string layers = "language_model.model.layers.";
    bool want = name.rfind("multi_modal_projector.", 0) == 0;
    if (name.rfind(layers, 0) == 0) {
      const int64_t i = std::stoll(name.substr(layers.size()));
      want = cross.count(i) > 0;
      if (want && name.find(".mlp.") != std::string::npos) ++cross_mlp;
    }
    EXPECT_EQ(model->trains_cross_only(name), want) << name;
    trained += want;
  }
  EXPECT_GT(trained, 0u);
  EXPECT_EQ(cross_mlp, 3 * cross.size());  // gate, up and down projections of each cross layer
}

// lvx serve's visual cache (ModelInputs::media): a prefill hands back this rank's encoded images,
// and a prefill given them (no pixel_values at all) gives the same logits, bit for bit, as
// encoding again; features that do not fit the rank's slots are refused.
TEST(MllamaVisualCache, PrefillFromKeptFeaturesEqualsEncoding) {
  const Reference& ref = frames_reference();
  const auto batch = lvx::load_safetensors(ref.batch).tensors;
  const std::unique_ptr<lvx::models::Model> model = lvx::models::load_model(ref.model, at::kFloat);
  lvx::models::Parallel par;
  par.pg = std::make_shared<lvx::dist::ProcessGroup>(lvx::dist::RendezvousInfo{});
  lvx::models::LocalMedia kept;
  lvx::models::ModelInputs miss{batch.at("input_ids"), batch.at("pixel_values"), false, {}};
  miss.media = &kept;
  lvx::models::DecodeCache c1, c2;
  const at::Tensor first = model->prefill(miss, par, c1);
  ASSERT_TRUE(kept.features.defined());
  EXPECT_EQ(static_cast<int64_t>(kept.slots.size()),
            batch.at("input_ids").eq(model->media_token_id()).sum(1).max().item<int64_t>());
  lvx::models::ModelInputs hit{batch.at("input_ids"), at::Tensor(), false, {}};
  hit.media = &kept;
  EXPECT_TRUE(at::equal(model->prefill(hit, par, c2), first));
  lvx::models::LocalMedia wrong = kept;
  wrong.features = kept.features.narrow(1, 0, kept.features.size(1) - 1);
  hit.media = &wrong;
  lvx::models::DecodeCache c3;
  try {
    model->prefill(hit, par, c3);
    ADD_FAILURE() << "features of the wrong shape were taken";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("precomputed media features"), std::string::npos)
        << e.what();
  }
}

// Model::extend (follow-up questions about a kept prompt, lvx serve): the frames' prompt up to
// its last image token as a prefill, then the rest in one extend, equals the whole prompt's
// prefill and the rest as decode steps (tests/model_extend.h); fp32 within 1e-5. 3 text tokens are
// appended so that every row ends in text after its last image.
TEST(MllamaExtend, PrefixPrefillAndExtendEqualTheWholePrefill) {
  const Reference& ref = frames_reference();
  const auto batch = lvx::load_safetensors(ref.batch).tensors;
  const auto model = lvx::models::load_model(ref.model, at::kFloat);
  ASSERT_TRUE(model->can_extend());
  const at::Tensor ids = with_text_tail(batch.at("input_ids"));
  const ExtendDiff d = extend_against_prefill(*model, ids, batch.at("pixel_values"));
  std::cout << "split " << d.split << " of " << d.length << ", |extend − whole| " << d.whole
            << ", |extend − decode steps| " << d.steps << ", next step " << d.next << "\n";
  EXPECT_LE(d.whole, 1e-5);
  EXPECT_LE(d.steps, 1e-5);
  EXPECT_LE(d.next, 1e-5);
}

// Chunked prefill (lvx serve's --max-batch-tokens, tests/model_extend.h): the frames prompt's
// prefix in chunks of 1 and 3 tokens, each token seeing the tiles its row of the processor's
// cross-attention mask gives it (every cross-attention call of mask.h; rows before the first
// image attend to every key and have their branch zeroed), sealed, then the question: within
// 1e-5 (fp32) of the whole prefill, at 1 rank and on 3 (the keys and prompt shards spread).
double mllama_chunked(std::shared_ptr<lvx::dist::ProcessGroup> pg) {
  const Reference& ref = frames_reference();
  const double worst = worst_chunked(ref.model, ref.batch, {1, 3}, pg);
  std::cout << "|chunked − whole| " << worst << "\n";
  return worst;
}

TEST(MllamaChunkedPrefill, ChunksEqualTheWholePrefill) { EXPECT_LE(mllama_chunked(nullptr), 1e-5); }

LVX_WORKER(mllama_chunked_ranks) {
  return mllama_chunked(lvx::dist::ProcessGroup::from_env()) <= 1e-5 ? 0 : 1;
}

TEST(MllamaChunkedPrefill, OnThreeRanksEqualsTheWholePrefill) {
  frames_reference();  // made once, before the ranks read it
  expect_all_ok(run_ranks(3, "mllama_chunked_ranks"));
}

// Model::decode_rows (continuous batching): three generations about the same frames at
// different lengths and one without images (its cross layers skipped), each prefilled alone,
// stepped together: every row's logits equal its own decode_step's within 1e-5 (fp32); one row
// alone is decode_step bit for bit (tests/model_rows.h). Then three prompts of one length, whose
// prompt keys join the rows' own keys' product (prompt_front): the same bound.
TEST(MllamaDecodeRows, RowsAtTheirOwnLengthsEqualEachAlone) {
  const Reference& ref = frames_reference();
  const auto batch = lvx::load_safetensors(ref.batch).tensors;
  const auto model = lvx::models::load_model(ref.model, at::kFloat);
  ASSERT_TRUE(model->batches_rows());
  const at::Tensor row0 = batch.at("input_ids").narrow(0, 0, 1);
  const int64_t images = row0.eq(model->media_token_id()).sum().item<int64_t>();
  const at::Tensor pixels = batch.at("pixel_values").narrow(0, 0, images);
  const RowsDiff d = decode_rows_against_steps(*model, row0, pixels,
                                               at::tensor({7, 8, 9, 10}, at::kLong).view({1, -1}));
  std::cout << "|rows together - each alone| " << d.worst << "\n";
  EXPECT_LE(d.worst, 1e-5);
  EXPECT_TRUE(d.lengths_equal);
  EXPECT_TRUE(d.one_row_bitwise);
  EXPECT_FALSE(d.fronted);  // prompts of three lengths: a call over each
  const RowsDiff one = decode_rows_against_steps(*model, row0, pixels, {}, /*one_length=*/true);
  std::cout << "one prompt length: |rows together - each alone| " << one.worst << "\n";
  EXPECT_LE(one.worst, 1e-5);
  EXPECT_TRUE(one.fronted);
}

// ---- lvx qa and lvx finetune on the tiny checkpoint ------------------------------------------

std::string make_clip(const std::string& name, const std::string& source) {
  const std::string path = (workdir() / name).string();
  EXPECT_EQ(run_command("ffmpeg -loglevel error -y -f lavfi -i " + source +
                        "=size=64x64:rate=4 -t 4 -pix_fmt yuv420p " + path),
            "");
  return path;
}

// One question about a generated video: the greedy answer is the same on 1 and 2 ranks, with
// every rank decoding (--decode-ranks all) and with rank 0 alone (one, models/lead_decode.h).
// With all, a decode step sends the pass-Q bytes, summed over the ranks: n·(n−1)·A·B·Hq·(D+1)·4
// with A = 5 attentions (3 self, 2 cross), B = 1, Hq = 4, D = 16. With one, only the cross
// layers' messages (and the prompt keys' one gather, counted with the prompt's bytes).
TEST(MllamaQa, GreedyAnswerIsTheSameOnOneAndTwoRanks) {
  const std::string clip = make_clip("mllama_qa.mp4", "testsrc");
  auto ask = [&](int n, const std::string& decode_ranks = "one") {
    const std::string out =
        run_command(lvx_binary() + " qa --model " + reference().model + " --video " + clip +
                    " --question 'What colour was the shape?' --num-frames 6 --json "
                    "--max-new-tokens 6 --decode-ranks " +
                    decode_ranks + " --nproc " + std::to_string(n) + " 2>/dev/null");
    try {
      return nlohmann::json::parse(out);
    } catch (const std::exception&) {
      ADD_FAILURE() << "not JSON: " << out;
      return nlohmann::json();
    }
  };
  const nlohmann::json one = ask(1), two = ask(2, "all"), lead = ask(2);
  ASSERT_TRUE(one.contains("response") && two.contains("response") && lead.contains("response"));
  EXPECT_EQ(one["frames"], 6);
  EXPECT_EQ(one["new_tokens"], 6);
  EXPECT_EQ(two["response"], one["response"]);
  EXPECT_EQ(lead["response"], one["response"]);
  EXPECT_EQ(two["bytes"]["decode_per_token"].get<int64_t>(), int64_t{2} * 1 * 5 * 1 * 4 * 17 * 4);
  // Lead: per step and each of the 2 cross layers, the query from rank 0 (B·Hq·D·4) and the
  // partial back (B·Hq·(D+1)·4); the prompt keys' gather counts as the prompt's.
  EXPECT_EQ(lead["bytes"]["decode_per_token"].get<int64_t>(),
            2 * (int64_t{1} * 4 * 16 * 4 + int64_t{1} * 4 * 17 * 4));
  EXPECT_GT(lead["bytes"]["prefill"].get<int64_t>(), two["bytes"]["prefill"].get<int64_t>());
}

// Fine-tuning on two generated videos: the loss falls, the vision model stays frozen, and the
// checkpoint is a model directory lvx loads as Mllama.
TEST(MllamaFinetune, LossFallsAndTheVisionModelStaysFrozen) {
  const fs::path d = workdir() / "mllama_finetune";
  fs::create_directories(d);
  const std::string a = make_clip("mllama_ft_a.mp4", "testsrc");
  const std::string b = make_clip("mllama_ft_b.mp4", "testsrc2");
  std::ofstream(d / "train.jsonl")
      << nlohmann::json{{"video", a},
                        {"question", "What pattern is shown?"},
                        {"answer", "color bars"}}
             .dump()
      << "\n"
      << nlohmann::json{{"video", b}, {"question", "What moves?"}, {"answer", "shapes"}}.dump()
      << "\n";
  const std::string ck = (d / "ck").string();
  fs::remove_all(ck);
  std::ofstream(d / "run.yaml") << "model: {path: " << reference().model << "}\n"
                                << "data: {train: " << (d / "train.jsonl").string()
                                << ", num_frames: 4, seed: 3}\n"
                                << "optimizer: {lr: 3.0e-3, weight_decay: 0.01, grad_clip: 1.0}\n"
                                << "schedule: {steps: 10, warmup_steps: 1, min_lr: 1.0e-4}\n"
                                << "checkpoint: {dir: " << ck << ", every: 5, keep: 2}\n"
                                << "parallel: {nproc: 2, strategies: \"lv_xattn,ring\"}\n";
  const std::string log =
      run_command(lvx_binary() + " finetune --config " + (d / "run.yaml").string());
  ASSERT_EQ(log.find("exit status"), std::string::npos) << log;
  std::vector<double> loss;
  std::ifstream m(ck + "/metrics.jsonl");
  for (std::string line; std::getline(m, line);)
    loss.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  ASSERT_EQ(loss.size(), 10u);
  std::cout << "mllama finetune loss: first two steps " << (loss[0] + loss[1]) / 2 << ", last two "
            << (loss[8] + loss[9]) / 2 << "\n";
  EXPECT_LT(loss[8] + loss[9], 0.5 * (loss[0] + loss[1]));
  const std::string last = ck + "/step-000010";
  const auto before = lvx::load_safetensors(reference().model + "/model.safetensors").tensors;
  const auto after = lvx::load_safetensors(last + "/model.safetensors").tensors;
  int64_t vision = 0, changed = 0;
  for (const auto& [name, t] : before) {
    ASSERT_TRUE(after.count(name)) << name;
    const bool same = at::equal(t, after.at(name).to(t.scalar_type()));
    if (name.rfind("vision_model.", 0) == 0) {
      ++vision;
      EXPECT_TRUE(same) << name << " (the vision model is frozen)";
    } else {
      changed += !same;
    }
  }
  EXPECT_GT(vision, 0);
  EXPECT_GT(changed, 0);
  EXPECT_EQ(lvx::models::load_model(last, at::kFloat)->family().model_type(), "mllama");
}

// Inputs the family does not read, and pixel_values in neither of its layouts, are named.
TEST(MllamaBadInput, UnknownInputsAndWrongPixelLayoutsAreNamed) {
  auto forward = [](const std::map<std::string, at::Tensor>& batch) {
    const std::string path = (workdir() / "mllama_bad_batch.safetensors").string();
    lvx::save_safetensors(path, batch);
    return run_command(lvx_binary() + " forward --model " + reference().model + " --input " + path +
                       " --output " + (workdir() / "mllama_bad.safetensors").string());
  };
  auto batch = lvx::load_safetensors(reference().batch).tensors;
  auto extra = batch;
  extra["attention_mask"] = at::ones_like(batch.at("input_ids"));
  std::string out = forward(extra);
  EXPECT_NE(out.find("Llama-3.2-Vision: unknown input 'attention_mask'"), std::string::npos) << out;
  auto flat = batch;
  flat["pixel_values"] = batch.at("pixel_values").flatten(0, 2);
  out = forward(flat);
  EXPECT_NE(out.find("pixel_values must be [2, images, 2 (max_num_tiles), 3, 16, 16]"),
            std::string::npos)
      << out;
  auto no_ratios = batch;
  no_ratios.erase("aspect_ratio_ids");
  out = forward(no_ratios);
  EXPECT_NE(out.find("needs aspect_ratio_ids and aspect_ratio_mask"), std::string::npos) << out;
}

}  // namespace
