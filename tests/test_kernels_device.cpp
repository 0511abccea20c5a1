// Devices as the kernels and timers see them: which GPU an unindexed device names
// (src/common/device_index.h) and waiting for a device's queued work (src/common/device_sync.h).
// Both run without a GPU; the GPU archive's kernel gate runs this binary on CUDA too.
#include <ATen/ATen.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <gtest/gtest.h>

#include "src/common/device_index.h"
#include "src/common/device_sync.h"

using lvx::resolve_device;
using lvx::same_device;

// A device written without an index is the current one of its type: "cuda" and "cuda:0" are the
// same GPU (no GPU needed: resolution falls back to index 0 where CUDA is absent), while c10's
// operator== tells them apart. The strategy suite (LVX_TEST_DEVICE=cuda) compares its results'
// devices through same_device().
TEST(DeviceIndex, UnindexedDeviceIsTheCurrentOne) {
  EXPECT_NE(at::Device("cuda"), at::Device("cuda:0"));  // why the helper exists
  EXPECT_TRUE(same_device(at::Device("cuda"), at::Device("cuda:0")));
  EXPECT_TRUE(same_device(at::Device("cuda:0"), at::Device("cuda")));
  EXPECT_FALSE(same_device(at::Device("cuda:0"), at::Device("cuda:1")));
  EXPECT_FALSE(same_device(at::Device("cpu"), at::Device("cuda:0")));
  EXPECT_TRUE(same_device(at::Device("cpu"), at::zeros({1}).device()));
  EXPECT_TRUE(same_device(at::Device("meta"), at::empty({1}, at::kMeta).device()));
  EXPECT_TRUE(resolve_device(at::Device("cuda")).has_index());
  // Without CUDA the unindexed device is cuda:0 (the first use would make it current); with it,
  // the current device, which nothing in this binary changes from 0.
  EXPECT_EQ(resolve_device(at::Device("cuda")), at::Device("cuda:0"));
  EXPECT_EQ(resolve_device(at::Device("cuda:1")), at::Device("cuda:1"));
}

// CPU and meta have nothing queued: synchronize returns (c10's CPU guard would throw "doesn't
// support synchronizing" if it were asked).
TEST(DeviceSync, CpuAndMetaReturnAtOnce) {
  EXPECT_NO_THROW(lvx::synchronize(at::Device("cpu")));
  EXPECT_NO_THROW(lvx::synchronize(at::Device("meta")));
}

// On a GPU: 200 fp32 products of 4096² (~27 TFLOP, well over 100 ms on any GPU of 2026) are still
// running when the host has queued them, and the stream is idle once synchronize returns. Written
// through c10's guard interface, as synchronize is, so this file needs no CUDA headers. A timer
// whose wait compiled to nothing made bench_kernels report 26 µs for a 160 µs kernel.
TEST(DeviceSync, AGpuIsIdleAfterwards) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device here; the GPU archive runs this";
  const at::Device dev = resolve_device(at::Device("cuda"));
  const auto* guard = c10::impl::getDeviceGuardImpl(dev.type());
  at::Tensor a = at::randn({4096, 4096}, at::TensorOptions().device(dev)).div_(64);
  for (int i = 0; i < 200; ++i) a = at::matmul(a, a).div_(a.size(0));
  const bool idle_before = guard->queryStream(guard->getStream(dev));
  lvx::synchronize(dev);
  EXPECT_FALSE(idle_before) << "the products finished before the host queued them all";
  EXPECT_TRUE(guard->queryStream(guard->getStream(dev)));
}
