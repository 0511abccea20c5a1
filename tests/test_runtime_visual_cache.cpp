// lvx serve's visual cache: the LRU's bytes and order (src/runtime/visual_cache.h), and the one
// hook every family's prefill shares (models/parallel.h encode_local_media with
// ModelInputs::media): features given are returned without encoding or reading pixels, and a
// miss hands back exactly what it encoded. End-to-end hits (a repeat decodes and encodes nothing
// and answers the same) are in tests/serve/test_serve.py.
#include <gtest/gtest.h>

#include "models/parallel.h"
#include "src/attention/media_mask.h"
#include "src/common/error.h"
#include "src/runtime/visual_cache.h"

namespace lvx::runtime {
namespace {

std::shared_ptr<VisualEntry> entry(int64_t floats, float value) {
  auto e = std::make_shared<VisualEntry>();
  e->media.features = at::full({1, floats, 1}, value);
  return e;
}

TEST(VisualCache, LeastRecentlyUsedGoesFirstWithinTheBytes) {
  const int64_t one = entry(100, 0)->bytes();  // 400 bytes of features
  ASSERT_EQ(one, 400);
  VisualCache cache(2 * one + 10);  // room for two
  EXPECT_TRUE(cache.put("a", entry(100, 1)));
  EXPECT_TRUE(cache.put("b", entry(100, 2)));
  ASSERT_TRUE(cache.find("a"));  // a is now the most recent: b goes when c comes
  EXPECT_TRUE(cache.put("c", entry(100, 3)));
  EXPECT_FALSE(cache.find("b"));
  ASSERT_TRUE(cache.find("a"));
  EXPECT_EQ(cache.find("a")->media.features[0][0][0].item<float>(), 1);
  EXPECT_EQ(cache.find("c")->media.features[0][0][0].item<float>(), 3);
  VisualCacheStats s = cache.stats();
  EXPECT_EQ(s.entries, 2);
  EXPECT_EQ(s.bytes, 2 * one);
  EXPECT_EQ(s.evictions, 1);
  EXPECT_EQ(s.hits, 4);
  EXPECT_EQ(s.misses, 1);
  // Replacing a key counts its bytes once; an entry larger than the whole cache is not kept
  // (and evicts nothing).
  EXPECT_TRUE(cache.put("a", entry(100, 4)));
  EXPECT_EQ(cache.stats().bytes, 2 * one);
  EXPECT_FALSE(cache.put("huge", entry(1000, 5)));
  EXPECT_EQ(cache.stats().entries, 2);
  EXPECT_FALSE(cache.find("huge"));
}

TEST(VisualCache, EncodeLocalMediaTakesGivenFeaturesAndHandsBackEncodedOnes) {
  // 4 images of 2 tokens each on rank 0 of 1: input_ids with media token 9.
  const at::Tensor ids = at::tensor({1, 9, 9, 9, 9, 2, 3}, at::kLong).unsqueeze(0);
  const attention::MediaMask mm = attention::media_mask({}, ids, 9, /*tokens_per_media=*/2);
  models::Parallel par;
  par.pg = std::make_shared<dist::ProcessGroup>(dist::RendezvousInfo{});  // one rank, no peers
  // [n, 3, 2, 2] → [n, 2, 3]: a known map, and the encoder that counts its calls.
  const auto reference = [](const at::Tensor& px) {
    return px.flatten(1).narrow(1, 0, 6).reshape({px.size(0), 2, 3}) * 2;
  };
  int calls = 0;
  const auto encode = [&](const at::Tensor& px) {
    ++calls;
    return reference(px);
  };
  const at::Tensor pixels = at::arange(4 * 3 * 2 * 2, at::kFloat).reshape({4, 3, 2, 2});
  models::LocalMedia kept;
  const models::LocalMedia first =
      models::encode_local_media(mm, pixels, true, par, 3, encode, pixels.options(), "test", &kept);
  EXPECT_EQ(calls, 1);
  ASSERT_TRUE(kept.features.defined());
  EXPECT_TRUE(at::equal(kept.features, first.features));
  EXPECT_TRUE(at::equal(first.features[0].narrow(0, 0, 2), reference(pixels.narrow(0, 0, 1))[0]));
  // Given features: no encoding, pixels never read (none given).
  const models::LocalMedia again = models::encode_local_media(
      mm, at::Tensor(), true, par, 3, encode, pixels.options(), "test", &kept);
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(at::equal(again.features, first.features));
  EXPECT_EQ(again.slots, first.slots);
  EXPECT_EQ(first.slots, (std::vector<int64_t>{0, 1, 2, 3}));
  // Features of another layout are refused, naming the slots.
  models::LocalMedia wrong = kept;
  wrong.slots = {0, 2};
  try {
    models::encode_local_media(mm, at::Tensor(), true, par, 3, encode, pixels.options(), "test",
                               &wrong);
    FAIL() << "features of other slots were accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("precomputed media features"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace lvx::runtime
