// The training samples' prefetch (src/runtime/sample_prefetch.h) against a counting fake
// preparation: samples come back in the order taken with what their preparation made, errors
// travel with their sample, no more than `depth` are prepared ahead, a sample taken out of order
// is prepared at once and the prefetch follows it, and depth 0 prepares on the caller's thread.
// (That the training run's bits do not change is Finetune.PrefetchGivesTheSameBitsAsNone.)
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <set>
#include <thread>

#include "src/runtime/sample_prefetch.h"

using lvx::runtime::LocalSample;
using lvx::runtime::SamplePrefetch;

namespace {

struct Fake {
  std::mutex mu;
  std::set<int64_t> made;
  std::atomic<int64_t> max_k{-1};
  std::set<std::thread::id> threads;
  LocalSample operator()(int64_t k) {
    {
      std::lock_guard<std::mutex> lock(mu);
      made.insert(k);
      threads.insert(std::this_thread::get_id());
    }
    int64_t m = max_k.load();
    while (k > m && !max_k.compare_exchange_weak(m, k)) {
    }
    LocalSample s;
    s.prompt.ids = {k};
    if (k % 7 == 6) s.error = "bad row " + std::to_string(k);
    return s;
  }
};

}  // namespace

TEST(SamplePrefetch, InOrderWithErrorsAndBoundedDepth) {
  Fake fake;
  SamplePrefetch p([&](int64_t k) { return fake(k); }, /*first=*/3, /*stride=*/2, /*depth=*/2,
                   /*workers=*/2);
  for (int64_t k = 3; k < 23; k += 2) {
    // The workers fill the depth before the step takes: wait until they have, then check the
    // bound (the sample taken next plus `depth` - 1 after it, at most).
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_LE(fake.max_k.load(), k + 2 * (2 - 1)) << "prepared too far ahead of " << k;
    const LocalSample s = p.take(k);
    ASSERT_EQ(s.prompt.ids.size(), 1u);
    EXPECT_EQ(s.prompt.ids[0], k);
    EXPECT_EQ(s.error, k % 7 == 6 ? "bad row " + std::to_string(k) : "") << k;
  }
  EXPECT_EQ(fake.threads.count(std::this_thread::get_id()), 0u) << "the workers prepare them";
}

TEST(SamplePrefetch, OutOfOrderTakeIsPreparedAtOnceAndFollowed) {
  Fake fake;
  SamplePrefetch p([&](int64_t k) { return fake(k); }, 0, 1, 3, 1);
  EXPECT_EQ(p.take(0).prompt.ids[0], 0);
  EXPECT_EQ(p.take(10).prompt.ids[0], 10);  // out of order: made here
  EXPECT_EQ(p.take(11).prompt.ids[0], 11);  // and the prefetch goes on from there
  EXPECT_EQ(p.take(12).prompt.ids[0], 12);
}

TEST(SamplePrefetch, DepthZeroPreparesOnTheCallersThread) {
  Fake fake;
  {
    SamplePrefetch p([&](int64_t k) { return fake(k); }, 0, 1, 0, 4);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_TRUE(fake.made.empty()) << "nothing ahead";
    EXPECT_EQ(p.take(0).prompt.ids[0], 0);
    EXPECT_EQ(p.take(1).prompt.ids[0], 1);
  }
  EXPECT_EQ(fake.threads.size(), 1u);
  EXPECT_EQ(fake.threads.count(std::this_thread::get_id()), 1u);
}
