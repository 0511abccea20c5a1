// Media masks from token ids (src/attention/media_mask.h) against the models' own mask code:
// tests/reference/media_mask_ref.py runs OpenFlamingo's MaskedCrossAttention (the open-flamingo
// package) and the released mPLUG-Owl3 240728/241101 mask lines on the same prompts and writes
// the dense visibility [B, L, slots * tokens_per_media]; here the dense visibility is rebuilt
// from (q_media, kv_media, rule) by a loop written from the rule text of kernels/attention.h and
// compared exactly. Plus hand-written cases with the expected indices spelled out, the
// off-by-one between the rules on the media token's own row, and the input errors.
#include <gtest/gtest.h>

#include <cstdio>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "src/attention/media_mask.h"
#include "src/common/error.h"
#include "src/common/safetensors.h"
#include "tests/build_paths.h"
#include "tests/multirank.h"

using namespace lvx;
using attention::MediaMask;
using attention::MediaMaskRule;
using attention::MediaSees;
using kernels::MediaRule;

namespace {

// The released models' rules, stated by meaning under the names the reference writes (each
// family's folder under models/ derives its rule from the model's code and names it the same).
struct NamedRule {
  std::string name;
  MediaMaskRule rule;
};
const NamedRule kOpenFlamingo{"openflamingo", {MediaSees::kMostRecent, true}};
const NamedRule kOpenFlamingoAllPrevious{"openflamingo-all-previous",
                                         {MediaSees::kUpToMostRecent, true}};
const NamedRule kMplugOwl3_240728{"mplug-owl3-240728", {MediaSees::kUpToMostRecent, false}};
const NamedRule kMplugOwl3_241101{"mplug-owl3-241101", {MediaSees::kUpToMostRecent, true}};
const std::vector<NamedRule> kModels = {kOpenFlamingo, kOpenFlamingoAllPrevious, kMplugOwl3_240728,
                                        kMplugOwl3_241101};

std::string run(const std::string& cmd) { return lvx::testing::run_command(cmd); }

// int64 [rows, n / rows] from a list (at::tensor cannot pick an overload for mixed literals).
at::Tensor longs(std::vector<int64_t> v, int64_t rows) {
  return at::tensor(v, at::kLong).view({rows, -1});
}

// visible[b, t, j] from the kernels' rule text: kImmediate: kv == q, kUpTo: kv <= q; −1 on either
// side: not visible. Written as a loop on purpose (not kernels::mask_matrix).
at::Tensor dense_visibility(const MediaMask& m) {
  const auto q = m.q_media.contiguous(), kv = m.kv_media.contiguous();
  const int64_t B = q.size(0), L = q.size(1), K = kv.size(1);
  auto out = at::zeros({B, L, K}, at::kBool);
  auto qa = q.accessor<int32_t, 2>();
  auto ka = kv.accessor<int32_t, 2>();
  auto oa = out.accessor<bool, 3>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < L; ++t)
      for (int64_t j = 0; j < K; ++j) {
        const int32_t qi = qa[b][t], kj = ka[b][j];
        oa[b][t][j] = qi >= 0 && kj >= 0 && (m.rule == MediaRule::kImmediate ? kj == qi : kj <= qi);
      }
  return out;
}

// "" when equal, else where the first difference is.
std::string first_difference(const at::Tensor& got, const at::Tensor& want, const at::Tensor& ids) {
  if (got.sizes() != want.sizes()) {
    std::ostringstream os;
    os << "shape " << got.sizes() << " vs reference " << want.sizes();
    return os.str();
  }
  auto diff = got.ne(want).nonzero();
  if (diff.size(0) == 0) return "";
  const int64_t b = diff[0][0].item<int64_t>(), t = diff[0][1].item<int64_t>(),
                j = diff[0][2].item<int64_t>();
  std::ostringstream os;
  os << diff.size(0) << " entries differ; first at sample " << b << ", token " << t << ", key " << j
     << ": lvx " << got[b][t][j].item<bool>() << ", reference " << want[b][t][j].item<bool>()
     << "; input_ids[" << b << "] = " << ids[b];
  return os.str();
}

struct Case {
  std::string name;
  at::Tensor input_ids;  // int64 [B, L]
  int64_t media_token_id, tokens_per_media;
  std::optional<int64_t> slots;  // nullopt: the functions' default
};

// Random prompts: per sample a random image count in [0, max_images] at random distinct positions
// (so back-to-back images, position 0 and the last position come up), other tokens random ids.
at::Tensor random_prompts(at::Generator& gen, int64_t B, int64_t L, int64_t max_images,
                          int64_t media_token_id) {
  auto ids = at::randint(0, 1000, {B, L}, gen, at::kLong);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = at::randint(0, max_images + 1, {1}, gen, at::kLong).item<int64_t>();
    auto pos = at::randperm(L, gen, at::kLong).narrow(0, 0, n);
    ids[b].index_fill_(0, pos, media_token_id);
  }
  return ids;
}

std::vector<Case> reference_cases() {
  const int64_t I = 50279;  // an OpenFlamingo-like `<image>` id (never drawn as a text token)
  std::vector<Case> cases;
  // Every edge in one batch: images back to back and at position 0; none; only at the end; at
  // the end after others; a single image in the middle.
  cases.push_back({"edges",
                   longs({I,  11, 12, I,  I,  13, 14, I,  15,  //
                          21, 22, 23, 24, 25, 26, 27, 28, 29,  //
                          31, 32, 33, 34, 35, 36, 37, 38, I,   //
                          I,  42, 43, I,  45, 46, 47, 48, I,   //
                          51, 52, 53, 54, I,  56, 57, 58, 59},
                         5),
                   I, 2, std::nullopt});
  cases.push_back({"edges_extra_slot", cases[0].input_ids, I, 3, 5});
  auto gen = at::make_generator<at::CPUGeneratorImpl>(20241101);
  const int64_t shapes[][5] = {
      // B, L, max images, tokens per media, extra slots
      {4, 12, 3, 2, 0}, {3, 20, 5, 3, 1}, {5, 33, 4, 2, 0},  {2, 48, 8, 2, 2},
      {6, 16, 2, 4, 0}, {4, 40, 6, 3, 0}, {1, 10, 10, 2, 0}, {3, 25, 0, 2, 2},
  };
  int i = 0;
  for (const auto& s : shapes) {
    const int64_t id = 151646 + i;  // mPLUG-Owl3-like `<|image|>` ids
    auto ids = random_prompts(gen, s[0], s[1], s[2], id);
    std::optional<int64_t> slots;
    if (s[4] > 0) slots = ids.eq(id).sum(1).max().item<int64_t>() + s[4];
    cases.push_back({"random" + std::to_string(i++), ids, id, s[3], slots});
  }
  return cases;
}

}  // namespace

TEST(MediaMask, MatchesTheModelsOwnMaskCode) {
  const auto cases = reference_cases();
  // Our masks first; the reference gets the slot count they chose (the default included).
  std::map<std::string, at::Tensor> in;
  std::map<std::string, std::map<std::string, MediaMask>> ours;
  for (const auto& c : cases) {
    for (const auto& model : kModels)
      ours[c.name][model.name] = attention::media_mask(model.rule, c.input_ids, c.media_token_id,
                                                       c.tokens_per_media, c.slots);
    const int64_t slots = ours[c.name][kModels[0].name].slots;
    in[c.name + ".input_ids"] = c.input_ids;
    in[c.name + ".meta"] = longs({c.media_token_id, c.tokens_per_media, slots}, 1).view({-1});
  }
  const std::string dir = ::testing::TempDir();
  const std::string in_path = dir + "/lvx_media_mask_in.safetensors";
  const std::string out_path = dir + "/lvx_media_mask_ref.safetensors";
  std::remove(out_path.c_str());
  save_safetensors(in_path, in);
  const std::string log = run(lvx::testing::configured_python() + " " + lvx::testing::source_dir() +
                              "/tests/reference/media_mask_ref.py " + in_path + " " + out_path);
  ASSERT_EQ(log.find("exit status"), std::string::npos)
      << log << "\n(the reference needs open-flamingo, einops and einops-exts: run setup.sh)";
  std::cout << log;  // the reference's summary line
  const auto ref = load_safetensors(out_path).tensors;

  int compared = 0;
  for (const auto& c : cases) {
    for (const auto& model : kModels) {
      const auto& m = ours.at(c.name).at(model.name);
      const std::string key = c.name + "." + model.name;
      SCOPED_TRACE(key);
      ASSERT_TRUE(ref.count(key)) << "reference has no " << key;
      const auto vis = dense_visibility(m);
      EXPECT_EQ(first_difference(vis, ref.at(key), c.input_ids), "");
      // The kernels read the indices the same way.
      const auto kmask =
          kernels::mask_matrix(m.attention_mask(), vis.size(0), vis.size(1), vis.size(2));
      EXPECT_TRUE(at::equal(kmask.to(at::kBool), vis)) << "kernels::mask_matrix disagrees";
      ++compared;
    }
    // media_starts: in 241101's t2v mask image j is first seen on the row of its own token.
    const auto& m = ours.at(c.name).at(kMplugOwl3_241101.name);
    const auto seen =
        ref.at(c.name + ".mplug-owl3-241101")
            .view({c.input_ids.size(0), c.input_ids.size(1), m.slots, c.tokens_per_media})
            .select(3, 0);  // [B, L, slots]
    const auto first_row = at::where(seen.any(1), seen.to(at::kLong).argmax(1), -1);
    EXPECT_TRUE(at::equal(m.media_starts, first_row))
        << c.name << ": media_starts " << m.media_starts << "\nreference " << first_row;
  }
  EXPECT_EQ(compared, static_cast<int>(cases.size() * kModels.size()));
}

TEST(MediaMask, HandWrittenIndices) {
  const int64_t I = 7;
  // Sample 0: images at 0, 3, 4 (back to back); sample 1: none; sample 2: one image, last token.
  const auto ids = longs({I, 1, 2, I, I, 3,  //
                          1, 2, 3, 4, 5, 6,  //
                          1, 2, 3, 4, 5, I},
                         3);
  auto i32 = [](std::vector<int32_t> v, int64_t rows) {
    return at::tensor(v, at::kInt).view({rows, -1});
  };
  // c_in (images at <= t) − 1 and c_ex (images at < t) − 1.
  const auto inclusive = i32({0, 0, 0, 1, 2, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0}, 3);
  const auto exclusive =
      i32({-1, 0, 0, 0, 1, 2, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1}, 3);
  const auto kv = i32({0, 0, 1, 1, 2, 2, -1, -1, -1, -1, -1, -1, 0, 0, -1, -1, -1, -1}, 3);
  const auto starts = longs({0, 3, 4, -1, -1, -1, 5, -1, -1}, 3);

  struct Want {
    NamedRule model;
    at::Tensor q;
    MediaRule rule;
  };
  for (const auto& w : {Want{kOpenFlamingo, inclusive, MediaRule::kImmediate},
                        Want{kOpenFlamingoAllPrevious, inclusive, MediaRule::kUpTo},
                        Want{kMplugOwl3_240728, exclusive, MediaRule::kUpTo},
                        Want{kMplugOwl3_241101, inclusive, MediaRule::kUpTo}}) {
    SCOPED_TRACE(w.model.name);
    const auto m = attention::media_mask(w.model.rule, ids, I, 2);
    EXPECT_EQ(m.slots, 3);
    EXPECT_EQ(m.tokens_per_media, 2);
    EXPECT_EQ(m.rule, w.rule);
    EXPECT_EQ(m.q_media.scalar_type(), at::kInt);
    EXPECT_EQ(m.kv_media.scalar_type(), at::kInt);
    EXPECT_EQ(m.media_starts.scalar_type(), at::kLong);
    EXPECT_TRUE(at::equal(m.q_media, w.q)) << m.q_media;
    EXPECT_TRUE(at::equal(m.kv_media, kv)) << m.kv_media;
    EXPECT_TRUE(at::equal(m.media_starts, starts)) << m.media_starts;
    const auto a = m.attention_mask();
    EXPECT_EQ(a.kind, kernels::MaskKind::kMedia);
    EXPECT_EQ(a.media_rule, w.rule);
  }
  // An explicit slot count pads every sample with absent images.
  const auto m = attention::media_mask(kMplugOwl3_241101.rule, ids, I, 1, 5);
  EXPECT_TRUE(
      at::equal(m.kv_media, i32({0, 1, 2, -1, -1, -1, -1, -1, -1, -1, 0, -1, -1, -1, -1}, 3)))
      << m.kv_media;
  EXPECT_TRUE(
      at::equal(m.media_starts, longs({0, 3, 4, -1, -1, -1, -1, -1, -1, -1, 5, -1, -1, -1, -1}, 3)))
      << m.media_starts;
  // No image anywhere: zero slots by default, every query sees nothing.
  const auto none = attention::media_mask(kOpenFlamingo.rule, ids.narrow(0, 1, 1), I, 4);
  EXPECT_EQ(none.slots, 0);
  EXPECT_EQ(none.kv_media.sizes(), (at::IntArrayRef{1, 0}));
  EXPECT_EQ(none.media_starts.sizes(), (at::IntArrayRef{1, 0}));
  EXPECT_TRUE(none.q_media.eq(-1).all().item<bool>());
}

// The off-by-one the models differ by, stated as what each row sees. On the row of the media
// token that introduces image k: OpenFlamingo sees exactly image k, 241101 images 0..k, 240728
// images 0..k−1. On every other row 240728 and 241101 agree, and OpenFlamingo sees exactly the
// most recent image.
TEST(MediaMask, RulesDifferByOneOnTheMediaTokenRow) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(8);
  const int64_t I = 99999, n = 3;
  const auto ids = random_prompts(gen, 6, 30, 6, I);
  ids[0][0] = I;  // an image at position 0 and back to back
  ids[0][1] = I;
  std::map<std::string, at::Tensor> vis;
  for (const auto& model : kModels)
    vis[model.name] = dense_visibility(attention::media_mask(model.rule, ids, I, n));
  const int64_t K = vis[kModels[0].name].size(2);
  auto images_seen = [&](const NamedRule& model, int64_t b, int64_t t) {
    std::vector<int64_t> seen;
    auto row = vis[model.name][b][t];
    for (int64_t j = 0; j < K; j += n) {
      const bool all = row.narrow(0, j, n).all().item<bool>(),
                 any = row.narrow(0, j, n).any().item<bool>();
      EXPECT_EQ(all, any) << "image " << j / n << " partly visible to sample " << b << " token "
                          << t;
      if (all) seen.push_back(j / n);
    }
    return seen;
  };
  auto range = [](int64_t lo, int64_t hi) {  // [lo, hi)
    std::vector<int64_t> v;
    for (int64_t i = lo; i < hi; ++i) v.push_back(i);
    return v;
  };
  int media_rows = 0;
  for (int64_t b = 0; b < ids.size(0); ++b) {
    int64_t k = -1;  // index of the most recent image at or before t
    for (int64_t t = 0; t < ids.size(1); ++t) {
      SCOPED_TRACE("sample " + std::to_string(b) + " token " + std::to_string(t));
      const bool is_media = ids[b][t].item<int64_t>() == I;
      if (is_media) ++k;
      const auto latest = k >= 0 ? std::vector<int64_t>{k} : std::vector<int64_t>{};
      EXPECT_EQ(images_seen(kOpenFlamingo, b, t), latest);
      EXPECT_EQ(images_seen(kOpenFlamingoAllPrevious, b, t), range(0, k + 1));
      EXPECT_EQ(images_seen(kMplugOwl3_241101, b, t), range(0, k + 1));
      EXPECT_EQ(images_seen(kMplugOwl3_240728, b, t), range(0, is_media ? k : k + 1));
      media_rows += is_media;
    }
  }
  EXPECT_GT(media_rows, 6);
}

// The names of the rules by meaning (the models' own names are models/' table:
// tests/test_models_media_rules.cpp).
TEST(MediaMask, RulesByMeaningHaveOneNameEach) {
  const auto rules = attention::media_mask_rules();
  ASSERT_EQ(rules.size(), 4u);
  std::vector<std::string> names;
  for (const auto& r : rules) {
    names.push_back(attention::media_mask_rule_name(r));
    EXPECT_EQ(attention::media_mask_rule_by_meaning(names.back()), r) << names.back();
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{"most-recent", "most-recent-after-token", "up-to-most-recent",
                                      "up-to-most-recent-after-token"}));
  EXPECT_EQ(attention::media_mask_rule_by_meaning("openflamingo"), std::nullopt);
  EXPECT_EQ((MediaMaskRule{MediaSees::kMostRecent, true}.kernel_rule()), MediaRule::kImmediate);
  EXPECT_EQ((MediaMaskRule{MediaSees::kUpToMostRecent, false}.kernel_rule()), MediaRule::kUpTo);
}

TEST(MediaMask, BadInputsAreNamed) {
  auto error_of = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const lvx::Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  auto expect_parts = [](const std::string& msg, const std::vector<std::string>& parts) {
    for (const auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << msg << "\nlacks: " << p;
  };
  const auto ids = longs({5, 1, 5, 2, 3, 5, 1, 1}, 2);
  const auto& of = kOpenFlamingo.rule;
  expect_parts(error_of([&] { attention::media_mask(of, ids.to(at::kInt), 5, 2); }),
               {"media_mask", "input_ids", "int64", "Int"});
  expect_parts(
      error_of([&] { attention::media_mask(kMplugOwl3_240728.rule, ids.view({-1}), 5, 2); }),
      {"media_mask", "input_ids", "rank 2", "rank 1"});
  expect_parts(error_of([&] { attention::media_mask(kMplugOwl3_241101.rule, ids, 5, 0); }),
               {"tokens_per_media", ">= 1", "got 0"});
  expect_parts(error_of([&] { attention::media_mask(of, ids, -3, 2); }),
               {"media_token_id", "got -3"});
  expect_parts(
      error_of([&] { attention::media_mask(kOpenFlamingoAllPrevious.rule, ids, 5, 2, 1); }),
      {"slots", "got 1", "sample 0", "2 media tokens"});
  expect_parts(error_of([&] { attention::media_mask(of, ids, 5, 2, -1); }),
               {"slots", ">= 0", "got -1"});
  // Enough slots: fine.
  EXPECT_EQ(attention::media_mask(of, ids, 5, 2, 2).kv_media.size(1), 4);
}
