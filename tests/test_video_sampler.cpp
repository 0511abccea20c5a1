// Sampling rules and rank sharding against brute-force restatements of the documented rules
// (video/sampler.h, docs/video.md) on hand-made constant and variable frame-rate timelines.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <random>

#include "src/common/error.h"
#include "video/sampler.h"

namespace lvx::video {
namespace {

Timeline cfr(int64_t n, double fps, double begin = 0) {
  Timeline t;
  for (int64_t i = 0; i < n; ++i) t.pts.push_back(begin + i / fps);
  t.end = begin + n / fps;
  return t;
}

Timeline random_vfr(std::mt19937& rng, int64_t n) {
  std::uniform_real_distribution<double> gap(0.01, 0.2);
  Timeline t;
  double x = 0;
  for (int64_t i = 0; i < n; ++i) {
    t.pts.push_back(x);
    x += gap(rng);
  }
  t.end = x;
  return t;
}

// Brute force "frame visible at t": scan for the last pts <= t.
int64_t visible_at(const Timeline& tl, double t) {
  int64_t best = -1;
  for (size_t i = 0; i < tl.pts.size(); ++i)
    if (tl.pts[i] <= t + kTimeEpsilon) best = static_cast<int64_t>(i);
  return best;
}

// The integer m nearest to k*L/(N-1), ties to the even one, found by search (no division).
int64_t nearest_even_tie(int64_t k, int64_t L, int64_t d) {
  int64_t best = 0;
  for (int64_t m = 0; m <= L; ++m) {
    const int64_t e = std::llabs(m * d - k * L), eb = std::llabs(best * d - k * L);
    if (e < eb || (e == eb && m % 2 == 0)) best = m;
  }
  return best;
}

TEST(VideoSampler, PlayedAtIsHalfOpenPerFrame) {
  const Timeline t = cfr(10, 10);  // frames at 0, 0.1, ..., 0.9; end 1.0
  EXPECT_EQ(played_at(t, 0.0), 0);
  EXPECT_EQ(played_at(t, 0.0999), 0);
  EXPECT_EQ(played_at(t, 0.1), 1);  // exactly on a pts: that frame
  EXPECT_EQ(played_at(t, 0.95), 9);
  EXPECT_EQ(played_at(t, 1.0), -1);  // end is exclusive
  EXPECT_EQ(played_at(t, -0.5), -1);
}

TEST(VideoSampler, FpsModeMatchesTheRuleOnVariableFrameRate) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const Timeline tl = random_vfr(rng, 5 + trial * 3);
    SampleSpec spec;
    spec.fps = 0.5 + trial * 0.37;
    if (trial % 3 == 1) spec.start = tl.pts[2] + 0.003;
    if (trial % 3 == 2) spec.end = tl.end * 0.7;
    const SampledFrames s = sample_frames(tl, spec);
    const double start = spec.start.value_or(tl.pts[0]);
    const double end = std::min(spec.end.value_or(tl.end), tl.end);
    std::vector<int64_t> expect;
    for (int64_t k = 0; start + k / *spec.fps < end; ++k)
      expect.push_back(std::max<int64_t>(0, visible_at(tl, start + k / *spec.fps)));
    EXPECT_EQ(s.indices, expect) << "trial " << trial;
  }
}

TEST(VideoSampler, FpsModeOnConstantRateTakesEveryKthFrame) {
  const Timeline tl = cfr(300, 30);  // 10 s at 30 fps
  SampleSpec spec;
  spec.fps = 2;
  const SampledFrames s = sample_frames(tl, spec);
  ASSERT_EQ(s.indices.size(), 20u);
  for (int64_t k = 0; k < 20; ++k) EXPECT_EQ(s.indices[k], 15 * k);
  // Faster than the source: frames repeat, none past the end.
  spec.fps = 60;
  const SampledFrames d = sample_frames(tl, spec);
  ASSERT_EQ(d.indices.size(), 600u);
  EXPECT_EQ(d.indices[1], 0);
  EXPECT_EQ(d.indices.back(), 299);
}

TEST(VideoSampler, UniformIncludesBothEndsAndRoundsHalfToEven) {
  std::mt19937 rng(11);
  for (int trial = 0; trial < 60; ++trial) {
    const Timeline tl = trial % 2 ? random_vfr(rng, 3 + trial) : cfr(3 + trial, 25);
    SampleSpec spec;
    spec.num_frames = 1 + trial % 17;
    if (trial % 4 == 3) {
      spec.start = tl.pts[1];
      spec.end = tl.pts[tl.pts.size() - 1];  // excludes the last frame
    }
    const SampledFrames s = sample_frames(tl, spec);
    const int64_t first = spec.start ? 1 : 0;
    const int64_t last = static_cast<int64_t>(tl.pts.size()) - (spec.end ? 2 : 1);
    ASSERT_EQ(static_cast<int64_t>(s.indices.size()), *spec.num_frames);
    EXPECT_EQ(s.indices.front(), first);
    if (*spec.num_frames > 1) {
      EXPECT_EQ(s.indices.back(), last);
    }
    for (int64_t k = 0; k<*spec.num_frames&& * spec.num_frames> 1; ++k) {
      EXPECT_EQ(s.indices[k], first + nearest_even_tie(k, last - first, *spec.num_frames - 1))
          << "trial " << trial << " k " << k;
    }
  }
  // A tie: 5 frames over 0..6 → 0, 1.5, 3, 4.5, 6 → 0, 2, 3, 4, 6.
  SampleSpec spec;
  spec.num_frames = 5;
  EXPECT_EQ(sample_frames(cfr(7, 1), spec).indices, (std::vector<int64_t>{0, 2, 3, 4, 6}));
}

TEST(VideoSampler, ShardsAreStripedBalancedAndCoverEverythingOnce) {
  for (int64_t m = 0; m < 40; ++m) {
    for (int64_t n = 1; n <= 9; ++n) {
      std::vector<int> seen(static_cast<size_t>(m), 0);
      for (int64_t r = 0; r < n; ++r) {
        const std::vector<int64_t> mine = shard_positions(m, {r, n});
        EXPECT_LE(static_cast<int64_t>(mine.size()), m / n + 1);
        EXPECT_GE(static_cast<int64_t>(mine.size()), m / n);
        for (size_t i = 0; i < mine.size(); ++i) {
          EXPECT_EQ(mine[i], r + static_cast<int64_t>(i) * n) << "m " << m << " n " << n;
          ++seen[static_cast<size_t>(mine[i])];
        }
      }
      for (int c : seen) EXPECT_EQ(c, 1) << "m " << m << " n " << n;  // no gap, no overlap
    }
  }
}

TEST(VideoSampler, BadSpecsAreErrorsThatSayWhy) {
  const Timeline tl = cfr(10, 10);
  SampleSpec both;
  both.fps = 1;
  both.num_frames = 3;
  EXPECT_THROW(sample_frames(tl, both), lvx::Error);
  EXPECT_THROW(sample_frames(tl, SampleSpec{}), lvx::Error);
  SampleSpec neg;
  neg.fps = -1;
  EXPECT_THROW(sample_frames(tl, neg), lvx::Error);
  SampleSpec late;
  late.num_frames = 2;
  late.start = 5.0;
  try {
    sample_frames(tl, late);
    FAIL() << "start past the end was accepted";
  } catch (const lvx::Error& e) {
    EXPECT_NE(std::string(e.what()).find("past the end"), std::string::npos) << e.what();
  }
  SampleSpec inverted;
  inverted.num_frames = 2;
  inverted.start = 0.5;
  inverted.end = 0.2;
  EXPECT_THROW(sample_frames(tl, inverted), lvx::Error);
  EXPECT_THROW(shard_positions(10, {3, 3}), lvx::Error);
  EXPECT_EQ(round_div_half_even(5, 2), 2);
  EXPECT_EQ(round_div_half_even(7, 2), 4);
  EXPECT_EQ(round_div_half_even(8, 3), 3);
}

// More samples than the range can give (kMaxSamplesPerFrame per frame in it) are refused before
// a vector of them is built: --num-frames 1e9 or --fps 1e9 must not allocate gigabytes.
TEST(VideoSampler, CountsBeyondWhatTheRangeHoldsAreRefused) {
  const Timeline tl = cfr(30, 10);  // 3 s, 30 frames
  auto message = [&](const SampleSpec& spec) {
    try {
      sample_frames(tl, spec);
    } catch (const lvx::Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  SampleSpec many;
  many.num_frames = 1000000000;
  EXPECT_NE(message(many).find("num_frames 1000000000 is more than the range [0, 3) s can give: "
                               "it holds 30 frames"),
            std::string::npos)
      << message(many);
  SampleSpec fast;
  fast.fps = 1e9;
  EXPECT_NE(message(fast).find("lower the fps"), std::string::npos) << message(fast);
  // Up to the bound, frames repeat as documented.
  many.num_frames = kMaxSamplesPerFrame * 30;
  EXPECT_EQ(sample_frames(tl, many).indices.size(), static_cast<size_t>(kMaxSamplesPerFrame * 30));
  fast.fps = 10.0 * kMaxSamplesPerFrame;
  EXPECT_EQ(sample_frames(tl, fast).indices.size(), static_cast<size_t>(kMaxSamplesPerFrame * 30));
  // A range of one frame still allows a few repeats of it.
  many.num_frames = 4;
  many.start = 1.0;
  many.end = 1.05;
  EXPECT_EQ(sample_frames(tl, many).indices, (std::vector<int64_t>{10, 10, 10, 10}));
}

}  // namespace
}  // namespace lvx::video
