// models::side_by_side (a rows step's two threads, models/side_by_side.h): both parts run, on two
// threads when asked and on the caller otherwise; the caller's grad mode travels; an exception of
// either part comes back to the caller only after both parts ended (the side part refers to the
// caller's frame). Nothing here depends on timing: the parts wait for each other through flags.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>

#include "models/side_by_side.h"

namespace {

using lvx::models::side_by_side;

TEST(SideBySide, BothPartsRunOnTwoThreadsOnlyWhenAsked) {
  for (const bool overlap : {false, true}) {
    std::thread::id side_id, here_id;
    side_by_side(
        overlap, at::kCPU, [&] { side_id = std::this_thread::get_id(); },
        [&] { here_id = std::this_thread::get_id(); });
    EXPECT_EQ(here_id, std::this_thread::get_id());
    EXPECT_EQ(side_id != here_id, overlap);
  }
}

TEST(SideBySide, TheCallersGradModeTravels) {
  c10::AutoGradMode no_grad(false);
  bool side_grad = true;
  side_by_side(
      true, at::kCPU, [&] { side_grad = c10::GradMode::is_enabled(); }, [] {});
  EXPECT_FALSE(side_grad);
}

TEST(SideBySide, ErrorsComeBackAfterBothPartsEnded) {
  // The caller's part fails while the side part still waits for it: the side part finishes
  // first, then the caller's error is thrown.
  std::atomic<bool> here_failing{false}, side_done{false};
  EXPECT_THROW(side_by_side(
                   true, at::kCPU,
                   [&] {
                     while (!here_failing.load()) std::this_thread::yield();
                     side_done = true;
                   },
                   [&] {
                     here_failing = true;
                     throw std::runtime_error("here");
                   }),
               std::runtime_error);
  EXPECT_TRUE(side_done.load());
  // The side part's error reaches the caller too, after the caller's part ran.
  bool here_ran = false;
  try {
    side_by_side(
        true, at::kCPU, [] { throw std::invalid_argument("side"); }, [&] { here_ran = true; });
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_STREQ(e.what(), "side");
  }
  EXPECT_TRUE(here_ran);
}

}  // namespace
