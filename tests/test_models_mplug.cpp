// mPLUG-Owl3 conformance: tiny random checkpoints in the released layout (config.json,
// model.safetensors or a sharded index, tokenizer.json) and their expected logits, loss and
// gradients come from an independent PyTorch reference (tests/reference/mplug_owl3_ref.py:
// transformers' Qwen2 and SigLIP, the hyper layer written from the model's description, in
// float64). `lvx forward` must match it at world sizes 1–4, for every strategy choice, with and
// without K/V recomputation. Tolerance (fp32): logits and loss within 1e-4 absolute (outputs are
// O(1–10); measured ≈3e-6), every gradient within 1e-4 of its largest element (measured ≈3e-6).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "models/checkpoint.h"
#include "models/model.h"
#include "models/parallel.h"
#include "src/common/safetensors.h"
#include "src/dist/process_group.h"
#include "tests/model_conformance.h"
#include "tests/model_extend.h"
#include "tests/model_rows.h"

namespace {

using namespace lvx::testing;
namespace fs = std::filesystem;

std::string ref_script() {
  return lvx::testing::source_dir() + "/tests/reference/mplug_owl3_ref.py";
}

// A reference checkpoint, batch and expected outputs per variant, made once. 241101 is stored in
// 3 shards with an index and its images are interleaved with the text; "240728-bf16" is stored in
// bf16 (the releases' dtype; the reference upcasts the same values).
const Reference& reference(const std::string& variant) {
  static std::map<std::string, Reference> made;
  auto it = made.find(variant);
  if (it != made.end()) return it->second;
  const bool fused = variant == "241101", bf16 = variant == "240728-bf16";
  return made[variant] =
             reference_model("mplug_" + variant, ref_script(), script_stamp(ref_script()),
                             "--variant " + variant.substr(0, 6) + (fused ? " --shards 3" : "") +
                                 (bf16 ? " --dtype bf16" : ""),
                             fused ? "--layout interleaved" : "--layout video_qa");
}

struct Case {
  std::string variant;
  int nproc;
  std::string strategies;
  std::string flags;  // --recompute (LV-XAttn §3.2), --remat (DistFlashAttn §3.3)
};

// Readable parameters in test logs (not a byte dump).
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.variant << " on " << c.nproc << " ranks, " << c.strategies << " " << c.flags;
}

class MplugConformance : public ::testing::TestWithParam<Case> {};

TEST_P(MplugConformance, MatchesTheReference) {
  const Case& c = GetParam();
  const Diff d = forward_against(reference(c.variant), c.variant, c.nproc, c.strategies, c.flags);
  expect_conforms(d, 1e-4, 1e-4, 59);  // every trainable tensor of the tiny model (59 or 61)
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (const std::string variant : {"240728", "241101"}) {
    v.push_back({variant, 1, "lv_xattn,ring", ""});
    v.push_back({variant, 2, "lv_xattn,ring", "--recompute"});
    v.push_back({variant, 2, "ulysses,all_gather", "--remat"});
    v.push_back({variant, 3, "lv_xattn,striped", ""});
    v.push_back({variant, 3, "lv_xattn+ring,ring+lv_xattn", "--recompute --remat"});
    v.push_back({variant, 4, "all_gather,ring", ""});
  }
  // Stored in bf16, computed in fp32 (--dtype auto would compute bf16 on a CPU with native bf16
  // products: the releases' case, not this conformance's).
  v.push_back({"240728-bf16", 2, "lv_xattn,ring", "--dtype fp32"});
  // The planner's per-layer choice for this batch on a cluster config (printed with the plan).
  v.push_back({"241101", 3, "auto",
               "--cluster " + lvx::testing::source_dir() +
                   "/configs/clusters/h100_80g_16.yaml --print-plan"});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, MplugConformance, ::testing::ValuesIn(cases()),
                         [](const auto& info) {
                           std::string s = info.param.strategies;
                           for (char& ch : s)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           std::string variant = info.param.variant;
                           std::replace(variant.begin(), variant.end(), '-', '_');
                           std::string flags =
                               info.param.flags.substr(0, info.param.flags.find(' ', 3));
                           for (char& ch : flags)
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return "v" + variant + "_n" + std::to_string(info.param.nproc) + "_" +
                                  s + flags;
                         });

// Greedy generation (prefill, then pass-Q decode steps through each rank's KV cache) equals the
// reference's greedy loop without a cache (the whole fp64 forward again for every token), token
// for token, at world sizes 1–4 and for several prefill plans; every step's logits within 1e-4
// (measured ≈1.5e-6). Each decode step sends exactly the pass-Q formula's bytes (models/decode.h):
// (n−1)·A·B·Hq·(D+1)·4 per rank, A = 4 self + 2 cross attentions in the tiny model.
// With --max-batch-tokens the prefix is prefilled in chunks (lvx serve's chunked prefill) and
// must give the reference's tokens too.
struct GenCase {
  std::string variant;
  int nproc;
  std::string strategies;
  std::string flags;
};

void PrintTo(const GenCase& c, std::ostream* os) {
  *os << c.variant << " on " << c.nproc << " ranks, " << c.strategies << " " << c.flags;
}

class MplugGeneration : public ::testing::TestWithParam<GenCase> {};

TEST_P(MplugGeneration, GreedyTokensEqualTheReferenceLoop) {
  const GenCase& c = GetParam();
  const Reference& ref = reference(c.variant);
  const auto meta = generate_against(ref, "mplug_generate_" + c.variant, ref_script(),
                                     script_stamp(ref_script()), c.nproc, c.strategies, 6, c.flags);
  ASSERT_FALSE(meta.empty());
  // B = 2, Hq = 4, D = 16; 4 layers of which 2 have a cross-attention. Every rank decoding: one
  // pass-Q message per layer; rank 0 alone (the default): only the 2 cross layers'.
  const bool all = c.flags.find("--decode-ranks all") != std::string::npos;
  const int64_t formula = all || c.nproc == 1 ? int64_t{c.nproc - 1} * 6 * 2 * 4 * 17 * 4
                                              : 2 * lead_cross_bytes(c.nproc, 2, 4, 16);
  EXPECT_EQ(std::stoll(meta.at("decode_bytes_sent_per_token")), formula);
  // The prompt ran as a prefill of its prefix (up to the last image token) and one extend of the
  // rest (src/runtime/generate.h), the path lvx serve's kept prefixes take; 241101's batch ends
  // with an image, so its prompt runs whole.
  EXPECT_EQ(std::stoll(meta.at("prefix_tokens")), c.variant == "240728" ? 6 : 0);
  // Chunks of 2 and 4 of those 6 tokens: 3 and 2 chunks; none without the flag.
  const size_t at = c.flags.find("--max-batch-tokens ");
  const int64_t chunks = at == std::string::npos ? 0 : c.flags[at + 19] == '2' ? 3 : 2;
  EXPECT_EQ(std::stoll(meta.at("prefill_chunks")), chunks);
}

// Model::decode_rows (continuous batching): three generations of the same video at different
// lengths (the prompt, then 2 and 5 more tokens) and one without images, each prefilled alone,
// then stepped together for 4 tokens (tests/model_rows.h): every row's logits equal its own
// decode_step's within 1e-5 (fp32; the projections run as one product over the rows, the cached
// keys per video, the rows' own keys in one masked product); one row alone is bitwise
// decode_step. Both variants (gated and one-softmax cross-attention). Then three prompts of one
// length, whose prompt keys join the rows' own keys' product (prompt_front): the same bound.
TEST(MplugDecodeRows, RowsAtTheirOwnLengthsEqualEachAlone) {
  for (const std::string variant : {"240728", "241101"}) {
    const Reference& ref = reference(variant);
    const auto batch = lvx::load_safetensors(ref.batch).tensors;
    const auto model = lvx::models::load_model(ref.model, at::kFloat);
    ASSERT_TRUE(model->batches_rows());
    const at::Tensor row0 = batch.at("input_ids").narrow(0, 0, 1);
    const int64_t images = row0.eq(model->media_token_id()).sum().item<int64_t>();
    const at::Tensor pixels = batch.at("pixel_values").narrow(0, 0, images);
    const RowsDiff d = decode_rows_against_steps(
        *model, row0, pixels, at::tensor({7, 8, 9, 10}, at::kLong).view({1, -1}));
    std::cout << variant << ": |rows together - each alone| " << d.worst << "\n";
    EXPECT_LE(d.worst, 1e-5) << variant;
    EXPECT_TRUE(d.lengths_equal) << variant;
    EXPECT_TRUE(d.one_row_bitwise) << variant;  // the same products as decode_step
    EXPECT_FALSE(d.fronted) << variant;         // prompts of three lengths: a call over each
    const RowsDiff one = decode_rows_against_steps(*model, row0, pixels, {}, /*one_length=*/true);
    std::cout << variant << ": one prompt length: |rows together - each alone| " << one.worst
              << "\n";
    EXPECT_LE(one.worst, 1e-5) << variant;
    EXPECT_TRUE(one.fronted) << variant;
  }
}

// A variant's model on one rank, and row 0 of its batch up to its last image token with its
// images: the prompt prefix lvx serve keeps per cached video (split: its length).
struct KeptPrefix {
  std::unique_ptr<lvx::models::Model> model;
  lvx::models::Parallel par;
  lvx::models::ModelInputs head;
  int64_t split = 0;
};

KeptPrefix kept_prefix(const std::string& variant) {
  const Reference& ref = reference(variant);
  const auto batch = lvx::load_safetensors(ref.batch).tensors;
  KeptPrefix k;
  k.model = lvx::models::load_model(ref.model, at::kFloat);
  k.par.pg = std::make_shared<lvx::dist::ProcessGroup>(lvx::dist::RendezvousInfo{});
  const at::Tensor row0 = batch.at("input_ids").narrow(0, 0, 1);
  const int64_t media = k.model->media_token_id();
  const int64_t images = row0.eq(media).sum().item<int64_t>();
  for (int64_t t = 0; t < row0.size(1); ++t)
    if (row0[0][t].item<int64_t>() == media) k.split = t + 1;
  k.head = {row0.narrow(1, 0, k.split), batch.at("pixel_values").narrow(0, 0, images), false, {}};
  return k;
}

// Model::extend_rows of `tokens` on the caches `together` against each row alone on `alone` (its
// extend, or its decode_step for one token), then the next decode step from the caches each
// leaves: the largest difference. The rows' lengths must agree.
double rows_against_alone(const lvx::models::Model& model, const lvx::models::Parallel& par,
                          const std::vector<at::Tensor>& tokens,
                          std::vector<lvx::models::DecodeCache>& together,
                          std::vector<lvx::models::DecodeCache>& alone) {
  std::vector<lvx::models::DecodeCache*> rows;
  for (auto& c : together) rows.push_back(&c);
  const at::Tensor joint = model.extend_rows(tokens, par, rows);
  double worst = 0;
  auto diff = [](const at::Tensor& a, const at::Tensor& b) {
    return (a - b).abs().max().item<double>();
  };
  for (size_t r = 0; r < rows.size(); ++r) {
    const at::Tensor own = tokens[r].numel() == 1
                               ? model.decode_step(tokens[r], par, alone[r])
                               : model.extend(tokens[r].view({1, -1}), par, alone[r]);
    worst = std::max(worst, diff(joint.narrow(0, static_cast<int64_t>(r), 1), own));
    EXPECT_EQ(together[r].length, alone[r].length);
    const at::Tensor next = at::tensor({21}, at::kLong);
    worst = std::max(worst, diff(model.decode_step(next, par, together[r]),
                                 model.decode_step(next, par, alone[r])));
  }
  return worst;
}

// Model::extend_rows: three questions of different lengths after one kept prompt prefix (the
// frames and the text up to the last image token, the state rows about one cached video share in
// lvx serve), extended together, give each row's extend alone within 1e-5 (fp32), and leave
// caches that decode the same next token's logits. Both variants.
TEST(MplugExtendRows, QuestionsAfterOneKeptPrefixEqualEachAlone) {
  for (const std::string variant : {"240728", "241101"}) {
    const KeptPrefix k = kept_prefix(variant);
    const lvx::models::Parallel& par = k.par;
    lvx::models::DecodeCache prefix;
    k.model->prefill(k.head, par, prefix);
    const std::vector<at::Tensor> tails{at::tensor({5, 6, 7}, at::kLong),
                                        at::tensor({8}, at::kLong),
                                        at::tensor({9, 10, 11, 12, 13, 14}, at::kLong)};
    std::vector<lvx::models::DecodeCache> alone(3, prefix), together(3, prefix);
    const double worst = rows_against_alone(*k.model, par, tails, together, alone);
    std::cout << variant << ": split " << k.split << ", |rows extended together - each alone| "
              << worst << "\n";
    EXPECT_LE(worst, 1e-5) << variant;
  }
}

// Model::extend_rows as lvx serve's step runs it: the running rows' next token (one each) beside
// the questions of rows joining, in one forward; rows about two videos interleaved (two kept
// prefixes: the rows of each hold the same tensors, the groups not side by side; rows_by_keys
// puts them side by side). Each row's logits, and the next decode step's from the caches it
// leaves, equal the row's own extend or decode_step alone within 1e-5 (fp32). Both variants.
TEST(MplugExtendRows, DecodeTokensBesideQuestionsEqualEachAlone) {
  for (const std::string variant : {"240728", "241101"}) {
    const KeptPrefix k = kept_prefix(variant);
    const lvx::models::Model& model = *k.model;
    const lvx::models::Parallel& par = k.par;
    lvx::models::DecodeCache video_a, video_b;  // two prefixes: tensors of their own
    model.prefill(k.head, par, video_a);
    model.prefill(k.head, par, video_b);
    auto asked = [&](const lvx::models::DecodeCache& prefix, std::vector<int64_t> question) {
      lvx::models::DecodeCache c = prefix;
      model.extend(at::tensor(question, at::kLong).view({1, -1}), par, c);
      return c;
    };
    // Rows: a question joining about A; a running row about B; another joining about A; a
    // running row about A.
    std::vector<lvx::models::DecodeCache> alone{video_a, asked(video_b, {8, 9}), video_a,
                                                asked(video_a, {12, 13, 14})};
    std::vector<lvx::models::DecodeCache> together = alone;
    // lvx serve's order for such a step (step_together): A's rows side by side, then B's.
    EXPECT_EQ(lvx::models::rows_by_keys({&alone[0], &alone[1], &alone[2], &alone[3]}),
              (std::vector<size_t>{0, 2, 3, 1}));
    const std::vector<at::Tensor> tokens{
        at::tensor({5, 6, 7}, at::kLong), at::tensor({10}, at::kLong),
        at::tensor({15, 16}, at::kLong), at::tensor({17}, at::kLong)};
    const double worst = rows_against_alone(model, par, tokens, together, alone);
    std::cout << variant << ": |decode tokens beside questions - each alone| " << worst << "\n";
    EXPECT_LE(worst, 1e-5) << variant;
  }
}

// Model::extend_rows over three videos whose prompts have one length (lvx serve's common case:
// frames sampled to one count): their prompt keys are read in one call over the batch's stack
// (models/decode_rows.cpp, stacked_partial; the path across ranks, here on one rank with the
// rows' prompt fronts off). A step where a question joins (the one-token rows stacked, the
// question's tokens in a call of their own), then a step of one token per row (every token
// stacked): each row's logits equal its own extend or decode_step alone within 1e-5 (fp32), and
// the rows' pool holds the three videos' stack. Both variants.
TEST(MplugExtendRows, StackedPromptKeysEqualEachAlone) {
  for (const std::string variant : {"240728", "241101"}) {
    const KeptPrefix k = kept_prefix(variant);
    const lvx::models::Model& model = *k.model;
    lvx::models::Parallel par = k.par;
    par.prompt_front_elements = 0;  // the stacked call, not the rows' prompt fronts
    std::vector<lvx::models::DecodeCache> videos(3);  // three prefixes: tensors of their own
    for (lvx::models::DecodeCache& v : videos) model.prefill(k.head, par, v);
    auto asked = [&](const lvx::models::DecodeCache& prefix, int64_t token) {
      lvx::models::DecodeCache c = prefix;
      model.extend(at::tensor({token, token + 1}, at::kLong).view({1, -1}), par, c);
      return c;
    };
    auto ids = [](std::vector<int64_t> t) { return at::tensor(t, at::kLong); };
    // Rows: a question joining about A; running rows about A, B and C.
    std::vector<lvx::models::DecodeCache> alone{videos[0], asked(videos[0], 8),
                                                asked(videos[1], 10), asked(videos[2], 12)};
    std::vector<lvx::models::DecodeCache> together = alone;
    std::vector<lvx::models::DecodeCache*> rows;
    for (lvx::models::DecodeCache& c : together) rows.push_back(&c);
    double worst = 0;
    auto step = [&](const std::vector<at::Tensor>& tokens) {
      const at::Tensor joint = model.extend_rows(tokens, par, rows);
      EXPECT_EQ(rows[0]->pooled.pool()->stacked_sources(0), 3U) << variant;
      for (size_t r = 0; r < rows.size(); ++r) {
        const at::Tensor own = tokens[r].numel() == 1
                                   ? model.decode_step(tokens[r], par, alone[r])
                                   : model.extend(tokens[r].view({1, -1}), par, alone[r]);
        worst = std::max(
            worst, (joint.narrow(0, static_cast<int64_t>(r), 1) - own).abs().max().item<double>());
      }
    };
    step({ids({5, 6, 7, 8, 9, 10}), ids({17}), ids({18}), ids({19})});
    step({ids({20}), ids({21}), ids({22}), ids({23})});
    std::cout << variant << ": |stacked prompt keys - each alone| " << worst << "\n";
    EXPECT_LE(worst, 1e-5) << variant;
  }
}

// Parallel::side_by_side (lvx serve --step-overlap): a rows step with each layer's visual-key
// calls on a second thread gives the logits of the same step on one thread bit for bit (the same
// calls on the same inputs), for a step with a joining question and a step of one token each,
// over three videos' rows. Both variants.
TEST(MplugExtendRows, SideBySideEqualsOneThreadExactly) {
  for (const std::string variant : {"240728", "241101"}) {
    const KeptPrefix k = kept_prefix(variant);
    const lvx::models::Model& model = *k.model;
    std::vector<lvx::models::DecodeCache> videos(3);
    for (lvx::models::DecodeCache& v : videos) model.prefill(k.head, k.par, v);
    std::vector<lvx::models::DecodeCache> one{videos[0], videos[0], videos[1], videos[2]};
    std::vector<lvx::models::DecodeCache> two = one;
    lvx::models::Parallel overlapped = k.par;
    overlapped.side_by_side = true;
    auto ids = [](std::vector<int64_t> t) { return at::tensor(t, at::kLong); };
    auto rows_of = [](std::vector<lvx::models::DecodeCache>& caches) {
      std::vector<lvx::models::DecodeCache*> rows;
      for (lvx::models::DecodeCache& c : caches) rows.push_back(&c);
      return rows;
    };
    for (const std::vector<at::Tensor>& tokens :
         {std::vector<at::Tensor>{ids({5, 6, 7, 8}), ids({9, 10}), ids({11, 12}), ids({13, 14})},
          std::vector<at::Tensor>{ids({20}), ids({21}), ids({22}), ids({23})}}) {
      const at::Tensor a = model.extend_rows(tokens, k.par, rows_of(one));
      const at::Tensor b = model.extend_rows(tokens, overlapped, rows_of(two));
      EXPECT_TRUE(at::equal(a, b))
          << variant << ": |overlapped - one thread| " << (a - b).abs().max().item<double>();
    }
  }
}

// Model::extend: a prefill of the prompt up to its last image token, then the rest in one extend,
// gives the last token's logits of a prefill of the whole prompt, and of the rest token by token
// through decode steps. fp32 within 1e-5 (the same sums in another order; a wrong position,
// mask or merge moves them by far more). Both variants (gated and one-softmax cross-attention);
// the batch gets 3 text tokens appended so that both rows end in text.
TEST(MplugExtend, PrefixPrefillAndExtendEqualTheWholePrefill) {
  for (const std::string variant : {"240728", "241101"}) {
    const Reference& ref = reference(variant);
    const auto batch = lvx::load_safetensors(ref.batch).tensors;
    const auto model = lvx::models::load_model(ref.model, at::kFloat);
    ASSERT_TRUE(model->can_extend());
    const at::Tensor ids = with_text_tail(batch.at("input_ids"));
    const ExtendDiff d = extend_against_prefill(*model, ids, batch.at("pixel_values"));
    std::cout << variant << ": split " << d.split << " of " << d.length << ", |extend − whole| "
              << d.whole << ", |extend − decode steps| " << d.steps << ", next step " << d.next
              << "\n";
    EXPECT_LE(d.whole, 1e-5) << variant;
    EXPECT_LE(d.steps, 1e-5) << variant;
    EXPECT_LE(d.next, 1e-5) << variant;  // the cache continues as after the whole prefill
  }
}

// Chunked prefill (lvx serve's --max-batch-tokens): the prompt prefix prefilled in chunks of 1, 2
// and 5 tokens, each token seeing only the images before it (241101's batch interleaves images
// and text), then the question extended: within 1e-5 of the whole prefill's logits and next
// step (fp32; the text keys merge in another order). Both variants.
TEST(MplugChunkedPrefill, ChunksEqualTheWholePrefill) {
  for (const std::string variant : {"240728", "241101"}) {
    const Reference& ref = reference(variant);
    const auto batch = lvx::load_safetensors(ref.batch).tensors;
    const auto model = lvx::models::load_model(ref.model, at::kFloat);
    ASSERT_TRUE(model->can_prefill_in_chunks());
    const at::Tensor ids = with_text_tail(batch.at("input_ids"));
    for (int64_t chunk : {1, 2, 5}) {
      const double d = chunked_against_prefill(*model, ids, batch.at("pixel_values"), chunk);
      std::cout << variant << " chunks of " << chunk << ": |chunked − whole| " << d << "\n";
      EXPECT_LE(d, 1e-5) << variant << " chunk " << chunk;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Cases, MplugGeneration,
    ::testing::Values(GenCase{"240728", 1, "lv_xattn,ring", ""},
                      GenCase{"240728", 2, "lv_xattn,ring", ""},
                      GenCase{"240728", 2, "lv_xattn,ring", "--decode-ranks all"},
                      GenCase{"240728", 3, "all_gather,striped", "--decode-ranks all"},
                      GenCase{"241101", 2, "lv_xattn,striped", ""},
                      GenCase{"241101", 4, "lv_xattn,ring", ""},
                      GenCase{"240728", 2, "lv_xattn,ring", "--max-batch-tokens 2"},
                      GenCase{"240728", 3, "lv_xattn,ring", "--max-batch-tokens 4"}),
    [](const auto& info) {
      return "v" + info.param.variant + "_n" + std::to_string(info.param.nproc) + "_" +
             test_name(info.param.strategies) + test_name(info.param.flags);
    });

// Bad checkpoints and inputs give one clear error naming what is wrong.
class MplugBadInput : public ::testing::Test {
 protected:
  // A copy of the 240728 reference model with `edit` applied to its tensors and config.
  std::string edited(const std::string& name,
                     const std::function<void(lvx::models::StateDict&, nlohmann::json&)>& edit) {
    const Reference& ref = reference("240728");
    lvx::models::Checkpoint ck = lvx::models::load_checkpoint(ref.model);
    edit(ck.tensors, ck.config);
    const std::string dir = (workdir() / name).string();
    lvx::models::save_checkpoint(dir, ck.config, ck.tensors);
    fs::copy_file(fs::path(ref.model) / "tokenizer.json", fs::path(dir) / "tokenizer.json",
                  fs::copy_options::overwrite_existing);
    return dir;
  }
  std::string forward(const std::string& model) {
    return run_command(lvx_binary() + " forward --model " + model + " --input " +
                       reference("240728").batch + " --output " +
                       (workdir() / "bad_out.safetensors").string());
  }
};

TEST_F(MplugBadInput, MissingExtraAndMisshapedTensorsAreNamed) {
  const std::string q = "language_model.model.layers.1.self_attn.q_proj.weight";
  std::string out = forward(edited("missing", [&](auto& t, auto&) { t.erase(q); }));
  EXPECT_NE(out.find("missing 1: " + q), std::string::npos) << out;
  out = forward(
      edited("extra", [&](auto& t, auto&) { t["language_model.model.extra"] = at::zeros({2}); }));
  EXPECT_NE(out.find("unexpected 1: language_model.model.extra"), std::string::npos) << out;
  out = forward(edited("shape", [&](auto& t, auto&) { t[q] = at::zeros({3, 3}); }));
  EXPECT_NE(out.find("wrong shape 1: " + q + " [3, 3]"), std::string::npos) << out;
}

TEST_F(MplugBadInput, UnknownModelTypeAndBadTokenizerAreNamed) {
  std::string dir = edited("type", [](auto&, auto& c) { c["model_type"] = "llava"; });
  std::string out = forward(dir);
  EXPECT_NE(out.find("model_type 'llava' is not supported"), std::string::npos) << out;
  dir = edited("tokenizer", [](auto&, auto&) {});
  std::ofstream(fs::path(dir) / "tokenizer.json") << "{ not json";
  out = forward(dir);
  EXPECT_NE(out.find("tokenizer.json: not valid JSON"), std::string::npos) << out;
}

TEST_F(MplugBadInput, ImagesThatDoNotMatchTheImageTokensAreNamed) {
  const Reference& ref = reference("240728");
  auto batch = lvx::load_safetensors(ref.batch).tensors;
  batch["pixel_values"] = batch["pixel_values"].narrow(0, 0, 1);
  const std::string path = (workdir() / "one_image.safetensors").string();
  lvx::save_safetensors(path, batch);
  const std::string out = run_command(lvx_binary() + " forward --model " + ref.model + " --input " +
                                      path + " --output " + (workdir() / "x.safetensors").string());
  EXPECT_NE(out.find("input_ids hold 5 media tokens"), std::string::npos) << out;
  EXPECT_NE(out.find("pixel_values has [1, 3"), std::string::npos) << out;
}

}  // namespace

// One model description: the planner's shipped YAMLs equal what the runtime derives from the
// releases' config.json (fields as published for mPLUG-Owl3-7B-240728 and 1B-241014).
#include "models/mplug_owl3/model.h"
#include "src/planner/model_yaml.h"

namespace {

nlohmann::json release_config(int64_t hidden, int64_t layers, int64_t heads, int64_t kv,
                              int64_t mlp, std::vector<int64_t> hyper) {
  return {{"model_type", "mplugowl3"},
          {"hidden_size", hidden},
          {"num_hidden_layers", layers},
          {"num_attention_heads", heads},
          {"num_key_value_heads", kv},
          {"intermediate_size", mlp},
          {"vocab_size", 151851},
          {"rope_theta", 1e6},
          {"rms_norm_eps", 1e-6},
          {"hyper_layers", hyper},
          {"vision_config",
           {{"hidden_size", 1152},
            {"image_size", 384},
            {"intermediate_size", 4304},
            {"model_type", "siglip_vision_model"},
            {"num_attention_heads", 16},
            {"num_hidden_layers", 27},
            {"patch_size", 14}}}};
}

TEST(MplugDescription, PlannerYamlsEqualTheReleasesConfigs) {
  for (const auto& [yaml, cfg] : std::vector<std::pair<std::string, nlohmann::json>>{
           {"mplug_owl3_7b", release_config(3584, 28, 28, 4, 18944, {1, 9, 17, 25})},
           {"mplug_owl3_1b", release_config(896, 24, 14, 2, 4864, {6, 13, 20, 22})}}) {
    SCOPED_TRACE(yaml);
    const auto want = lvx::planner::load_model_config(lvx::testing::source_dir() +
                                                      "/configs/models/" + yaml + ".yaml");
    const auto got =
        lvx::models::MplugOwl3::planner_model(lvx::models::mplug_owl3_config(cfg, yaml, true, 0));
    EXPECT_EQ(got.visual_tokens_per_frame, want.visual_tokens_per_frame);
    EXPECT_EQ(got.visual_feature_dim, want.visual_feature_dim);
    EXPECT_EQ(got.vision.layers, want.vision.layers);
    EXPECT_EQ(got.vision.hidden_size, want.vision.hidden_size);
    ASSERT_EQ(got.layers.size(), want.layers.size());
    for (size_t i = 0; i < got.layers.size(); ++i) {
      const auto &g = got.layers[i], &w = want.layers[i];
      EXPECT_TRUE(g.kind == w.kind && g.heads == w.heads && g.kv_heads == w.kv_heads &&
                  g.head_dim == w.head_dim && g.hidden_size == w.hidden_size && g.mask == w.mask &&
                  g.mlp_size == w.mlp_size)
          << "attention layer " << i;
    }
  }
}

}  // namespace
