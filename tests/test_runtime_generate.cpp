// Generations stepping together (src/runtime/generate.h Generation, step_together): what lvx
// serve's continuous batching runs. On the tiny mPLUG-Owl3 (tests/reference/mplug_owl3_ref.py),
// prompts of different lengths about the same frames, generated greedily:
//   - alone through generate() (lvx qa's path) and together, rows joining after others have
//     started (from the first row's kept prompt prefix, as serve's rows about one video do) and
//     leaving at their own max_new_tokens or stop token: every row's tokens are its tokens alone,
//     and its step logits within 1e-5 (fp32; the rows' projections run as one product, the
//     shared prefix's keys as one call, the generated keys as one padded product). (generate() itself is one generation
//     stepped alone: every generation conformance test covers that path.)
#include <gtest/gtest.h>

#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "models/decode.h"
#include "models/model.h"
#include "src/common/error.h"
#include "src/common/safetensors.h"
#include "src/dist/process_group.h"
#include "src/runtime/generate.h"
#include "tests/build_paths.h"
#include "tests/model_conformance.h"

namespace {

using namespace lvx::testing;
using lvx::runtime::GenerateOptions;
using lvx::runtime::Generation;

struct Fixture {
  std::unique_ptr<lvx::models::Model> model;
  lvx::models::Parallel par;
  at::Tensor row0, pixels;
};

Fixture& fixture() {
  static Fixture f = [] {
    const std::string script = lvx::testing::source_dir() + "/tests/reference/mplug_owl3_ref.py";
    const Reference ref = reference_model("mplug_240728", script, script_stamp(script),
                                          "--variant 240728", "--layout video_qa");
    Fixture x;
    x.model = lvx::models::load_model(ref.model, at::kFloat);
    x.par.pg = std::make_shared<lvx::dist::ProcessGroup>(lvx::dist::RendezvousInfo{});
    const auto batch = lvx::load_safetensors(ref.batch).tensors;
    x.row0 = batch.at("input_ids").narrow(0, 0, 1);
    const int64_t images = x.row0.eq(x.model->media_token_id()).sum().item<int64_t>();
    x.pixels = batch.at("pixel_values").narrow(0, 0, images);
    return x;
  }();
  return f;
}

lvx::models::ModelInputs prompt(const std::vector<int64_t>& extra) {
  Fixture& f = fixture();
  const at::Tensor ids =
      at::cat({f.row0, at::tensor(extra, at::kLong).view({1, -1})}, 1).contiguous();
  return {ids, f.pixels, false, {}};
}

GenerateOptions options(int64_t max_new) {
  GenerateOptions o;
  o.max_new_tokens = max_new;
  o.keep_logits = true;
  return o;
}

TEST(Generate, RowsSteppedTogetherGiveEachRowsTokensAlone) {
  Fixture& f = fixture();
  const std::vector<std::vector<int64_t>> extra{{}, {5, 6}, {5, 6, 7, 8, 9}};
  const std::vector<int64_t> max_new{6, 9, 4};
  std::vector<lvx::runtime::GenerateResult> alone;
  for (size_t r = 0; r < 3; ++r)
    alone.push_back(lvx::runtime::generate(*f.model, prompt(extra[r]), f.par, options(max_new[r])));
  // Row 0 starts; rows 1 and 2 join after 2 steps; each leaves at its own length. Rows 1 and 2
  // start from row 0's prompt prefix (the frames and the text up to the last image
  // token), as lvx serve's rows about one cached video do: the three hold the same prefix
  // tensors, whose keys one call then serves for all (shared_partial_attention).
  std::shared_ptr<lvx::models::DecodeCache> prefix;
  auto keeps = [&](int64_t max_new) {
    GenerateOptions o = options(max_new);
    o.store_prefix = [&](const lvx::models::DecodeCache& c) {
      prefix = std::make_shared<lvx::models::DecodeCache>(c);
    };
    return o;
  };
  auto reuses = [&](int64_t max_new) {  // its question's tokens left for the next step
    GenerateOptions o = options(max_new);
    o.cached_prefix = [&]() -> const lvx::models::DecodeCache* { return prefix.get(); };
    o.defer_tail = true;
    return o;
  };
  std::vector<std::unique_ptr<Generation>> rows;
  rows.push_back(std::make_unique<Generation>(*f.model, prompt(extra[0]), f.par, keeps(6)));
  ASSERT_TRUE(prefix);
  int64_t steps = 0, most = 0;
  for (;; ++steps) {
    if (steps == 2) {  // two join at once: their questions extended together (extend_rows)
      rows.push_back(std::make_unique<Generation>(*f.model, prompt(extra[1]), f.par, reuses(9)));
      rows.push_back(std::make_unique<Generation>(*f.model, prompt(extra[2]), f.par, reuses(4)));
    }
    std::vector<Generation*> running;
    for (auto& g : rows)
      if (!g->done()) running.push_back(g.get());
    if (running.empty() && steps > 2) break;
    most = std::max<int64_t>(most, static_cast<int64_t>(running.size()));
    if (!running.empty()) lvx::runtime::step_together(running, *f.model, f.par);
  }
  EXPECT_EQ(most, 3);  // the three were stepped together at some point
  for (size_t r = 0; r < 3; ++r) {
    const lvx::runtime::GenerateResult together = rows[r]->finish();
    SCOPED_TRACE("row " + std::to_string(r));
    ASSERT_EQ(together.tokens.sizes(), alone[r].tokens.sizes());
    EXPECT_TRUE(at::equal(together.tokens, alone[r].tokens));
    const double d = (together.step_logits - alone[r].step_logits).abs().max().item<double>();
    std::cout << "row " << r << ": " << together.tokens.size(1) << " tokens, |logits together - "
              << "alone| " << d << "\n";
    EXPECT_LE(d, 1e-5);
  }
}

// chunk_length (GenerateOptions::prefill_chunk_keys): the longest run of tokens from `at` whose
// key reads stay within the budget, at most `tokens`, one token at least even when it alone is
// over; without a budget, `tokens` up to the prefix's end.
TEST(ChunkLength, KeyBudgetCutsChunksWhereReadsPileUp) {
  using lvx::runtime::chunk_length;
  const at::Tensor reads = at::tensor({0, 0, 4, 4, 8, 8, 12, 100}, at::kLong);
  EXPECT_EQ(chunk_length(reads, 0, 8, 5, 0), 5);   // no budget
  EXPECT_EQ(chunk_length(reads, 6, 8, 5, 0), 2);   // the prefix ends
  EXPECT_EQ(chunk_length(reads, 0, 8, 5, 8), 4);   // 0 + 0 + 4 + 4 fits, + 8 does not
  EXPECT_EQ(chunk_length(reads, 0, 8, 3, 8), 3);   // the token bound comes first
  EXPECT_EQ(chunk_length(reads, 4, 8, 5, 16), 2);  // 8 + 8
  EXPECT_EQ(chunk_length(reads, 6, 8, 5, 16), 1);  // 12 fits, 12 + 100 does not
  EXPECT_EQ(chunk_length(reads, 7, 8, 5, 16), 1);  // over the budget alone: it still runs
  EXPECT_THROW(chunk_length(at::tensor({1, 2}, at::kLong), 0, 8, 5, 16), lvx::Error);
}

// A prompt prefilled in chunks under a key budget (lvx serve's --max-batch-visual-keys): the
// chunks shorten where the frames' keys pile up (their count made here from the prompt's key
// reads, cut greedily), and the tokens and every step's logits equal the whole prefill's within
// 1e-5 (fp32; the text keys merge in another order). The prompt: the fixture's prefix twice
// (twice its frames), then a question.
TEST(Generate, KeyBudgetChunksEqualTheWholePrefill) {
  Fixture& f = fixture();
  const int64_t first = lvx::runtime::prompt_prefix(f.row0, f.model->media_token_id());
  const at::Tensor head = f.row0.narrow(1, 0, first);
  const at::Tensor ids = at::cat({head, head, f.row0.narrow(1, first, f.row0.size(1) - first),
                                  at::tensor({5, 6, 7}, at::kLong).view({1, -1})},
                                 1)
                             .contiguous();
  const lvx::models::ModelInputs in{ids, at::cat({f.pixels, f.pixels}), false, {}};
  const auto whole = lvx::runtime::generate(*f.model, in, f.par, options(4));
  const int64_t split = lvx::runtime::prompt_prefix(ids, f.model->media_token_id());
  ASSERT_EQ(split, 2 * first);
  lvx::models::DecodeCache media;
  f.model->prefill_media({ids.narrow(1, 0, split), in.pixel_values, false, {}}, f.par, media);
  const at::Tensor reads = media.prompt_key_reads;
  ASSERT_EQ(reads.sizes(), at::IntArrayRef({split}));
  const int64_t last = reads[split - 1].item<int64_t>(), tokens = split - 1;
  ASSERT_GT(last, 0);
  const int64_t budget = last;  // one token per chunk where every frame is seen
  int64_t want = 0;
  for (int64_t at = 0; at < split; ++want) {
    int64_t n = 1, sum = reads[at].item<int64_t>();
    while (at + n < split && n < tokens && sum + reads[at + n].item<int64_t>() <= budget)
      sum += reads[at + n++].item<int64_t>();
    at += n;
  }
  GenerateOptions o = options(4);
  o.prefill_chunk = tokens;
  o.prefill_chunk_keys = budget;
  const auto chunked = lvx::runtime::generate(*f.model, in, f.par, o);
  std::cout << "prefix of " << split << " tokens, keys read";
  for (int64_t t = 0; t < split; ++t) std::cout << " " << reads[t].item<int64_t>();
  std::cout << ": " << chunked.prefill_chunks << " chunks under " << budget << " keys\n";
  EXPECT_EQ(chunked.prefill_chunks, want);
  EXPECT_GT(want, (split + tokens - 1) / tokens);  // the budget cut some chunks short
  EXPECT_TRUE(at::equal(chunked.tokens, whole.tokens));
  EXPECT_LE((chunked.step_logits - whole.step_logits).abs().max().item<double>(), 1e-5);
}

}  // namespace

// GenerateOptions::logprobs (lvx serve's logprobs / top_logprobs): each new token's
// log-probability and its 5 most likely alternatives equal log_softmax of the logits a whole
// prefill and then a decode step give (a path without the prompt prefix's split, the kept
// prefix or the sampler) within 1e-5, the greedy token is the most likely one, and the list has
// one entry per new token, alone and when rows step together.
TEST(Generate, LogprobsAreTheModelsLogSoftmax) {
  Fixture& f = fixture();
  const lvx::models::ModelInputs in = prompt({5, 6, 7});
  GenerateOptions o = options(3);
  o.logprobs = 5;
  const auto out = lvx::runtime::generate(*f.model, in, f.par, o);
  ASSERT_EQ(out.logprobs.size(), 3u);
  lvx::models::DecodeCache cache;
  at::Tensor logits = f.model->prefill(in, f.par, cache);
  for (size_t t = 0; t < 2; ++t) {
    const at::Tensor lp = at::log_softmax(logits[0], -1);
    const auto [values, ids] = at::topk(lp, 5);
    const auto& got = out.logprobs[t];
    EXPECT_EQ(got.token, out.tokens[0][static_cast<int64_t>(t)].item<int64_t>());
    EXPECT_EQ(got.token, got.top[0].first);  // greedy: the most likely token
    EXPECT_NEAR(got.logprob, lp[got.token].item<double>(), 1e-5);
    ASSERT_EQ(got.top.size(), 5u);
    for (int64_t i = 0; i < 5; ++i) {
      EXPECT_EQ(got.top[static_cast<size_t>(i)].first, ids[i].item<int64_t>()) << t << " " << i;
      EXPECT_NEAR(got.top[static_cast<size_t>(i)].second, values[i].item<double>(), 1e-5);
    }
    logits = f.model->decode_step(at::tensor({got.token}, at::kLong), f.par, cache);
  }
  // Two generations stepped together: each keeps its own entries, those it has alone.
  Generation a(*f.model, in, f.par, o), b(*f.model, prompt({5}), f.par, o);
  while (!a.done() || !b.done()) {
    std::vector<Generation*> rows;
    for (Generation* g : {&a, &b})
      if (!g->done()) rows.push_back(g);
    lvx::runtime::step_together(rows, *f.model, f.par);
  }
  ASSERT_EQ(a.logprobs().size(), 3u);
  for (size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(a.logprobs()[t].token, out.logprobs[t].token);
    EXPECT_NEAR(a.logprobs()[t].logprob, out.logprobs[t].logprob, 1e-5);
  }
  EXPECT_EQ(b.logprobs().size(), 3u);
}
