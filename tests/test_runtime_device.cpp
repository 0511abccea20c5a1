// --device and --dtype auto (src/runtime/device.h): the rule every computing command shares.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/runtime/device.h"

namespace lvx::runtime {
namespace {

template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(Device, AutoIsCudaLocalRankWhenThereAreGpusElseCpu) {
  EXPECT_EQ(choose_device("auto", 0, 1, 0), at::Device(at::kCPU));
  EXPECT_EQ(choose_device("auto", 3, 4, 0), at::Device(at::kCPU));
  EXPECT_EQ(choose_device("auto", 0, 1, 8), at::Device(at::kCUDA, 0));
  EXPECT_EQ(choose_device("auto", 5, 8, 8), at::Device(at::kCUDA, 5));
  EXPECT_EQ(choose_device("cuda", 2, 4, 4), at::Device(at::kCUDA, 2));
  EXPECT_EQ(choose_device("cpu", 2, 4, 4), at::Device(at::kCPU));
}

// auto with fewer GPUs than local ranks runs on the CPU and says why; cuda refuses, naming the
// --nproc that fits.
TEST(Device, AutoFallsBackToCpuWhenGpusAreFewerThanLocalRanks) {
  EXPECT_EQ(choose_device("auto", 0, 4, 2), at::Device(at::kCPU));
  EXPECT_EQ(choose_device("auto", 1, 2, 1), at::Device(at::kCPU));
  EXPECT_EQ(auto_device_note(2, 1),
            "--device auto: 2 local ranks but 1 GPU(s), and ranks never share a GPU: running on "
            "the CPU (--nproc 1 runs on the GPUs)");
  EXPECT_EQ(auto_device_note(2, 2), "");
  EXPECT_EQ(auto_device_note(2, 0), "");  // no GPU: the CPU is no fallback
}

TEST(Device, RefusesFewerGpusThanLocalRanksAndCudaWithoutOne) {
  const std::string few = error_of([] { choose_device("cuda", 0, 4, 2); });
  EXPECT_NE(few.find("4 local ranks need one GPU each but this machine has 2"), std::string::npos)
      << few;
  EXPECT_NE(few.find("use --nproc 2"), std::string::npos) << few;
  EXPECT_NE(error_of([] { choose_device("cuda", 0, 2, 1); }).find("has 1"), std::string::npos);
  EXPECT_NE(error_of([] { choose_device("cuda", 0, 1, 0); }).find("no CUDA device"),
            std::string::npos);
  EXPECT_NE(error_of([] { choose_device("gpu", 0, 1, 0); }).find("expected auto, cuda or cpu"),
            std::string::npos);
  EXPECT_NE(error_of([] { choose_device("cpu", 2, 2, 0); }).find("outside"), std::string::npos);
  // Validation before ranks start checks the spelling only (it may run where no GPU is).
  EXPECT_EQ(error_of([] { check_device_option("cuda"); }), "");
  EXPECT_NE(error_of([] { check_device_option("gpu"); }), "");
  // This machine: cpu always works; check_local_devices refuses like a rank would.
  EXPECT_EQ(error_of([] { check_local_devices("cpu", 64); }), "");
  if (cuda_device_count() == 0) {
    EXPECT_EQ(choose_device("auto"), at::Device(at::kCPU));
    EXPECT_NE(error_of([] { check_local_devices("cuda", 1); }), "");
  }
}

// auto: the checkpoint's dtype where the device computes it natively; on a CPU without native
// bf16 products, fp32 (given either way here, so the test does not depend on this CPU).
TEST(Device, DtypeAutoIsTheCheckpointsWhereTheDeviceComputesIt) {
  const at::Device cpu(at::kCPU), gpu(at::kCUDA, 0);
  EXPECT_EQ(resolve_dtype("auto", cpu, "bfloat16", /*cpu_bf16=*/false), "fp32");
  EXPECT_EQ(resolve_dtype("auto", cpu, "bfloat16", /*cpu_bf16=*/true), "bf16");
  EXPECT_EQ(resolve_dtype("auto", cpu, "float16", /*cpu_bf16=*/true), "bf16");
  EXPECT_EQ(resolve_dtype("auto", cpu, "float32", /*cpu_bf16=*/true), "fp32");
  EXPECT_NE(dtype_note("auto", cpu, "bfloat16", "bf16").find("natively"), std::string::npos);
  EXPECT_EQ(dtype_note("bf16", cpu, "bfloat16", "bf16"), "");
  EXPECT_EQ(dtype_note("auto", cpu, "float32", "fp32"), "");  // nothing to choose
  EXPECT_EQ(resolve_dtype("auto", gpu, "bfloat16"), "bf16");
  EXPECT_EQ(resolve_dtype("auto", gpu, ""), "bf16");
  EXPECT_EQ(resolve_dtype("auto", gpu, "float16"), "bf16");
  EXPECT_EQ(resolve_dtype("auto", gpu, "float32"), "fp32");
  EXPECT_EQ(resolve_dtype("bf16", cpu, "float32"), "bf16");
  EXPECT_EQ(resolve_dtype("fp32", gpu, "bfloat16"), "fp32");
  EXPECT_NE(error_of([&] { resolve_dtype("fp16", cpu, ""); }).find("expected fp32, bf16 or auto"),
            std::string::npos);
  EXPECT_EQ(dtype_of("bf16", "--dtype"), at::kBFloat16);
}

// src/common/dtype.h: the one name ↔ dtype mapping every flag and config field goes through.
TEST(Device, DtypeNamesMapBothWaysAndUnknownNamesAreRefusedByField) {
  const std::vector<std::pair<std::string, at::ScalarType>> known = {
      {"fp32", at::kFloat}, {"bf16", at::kBFloat16}, {"fp16", at::kHalf}};
  for (const auto& [name, t] : known) {
    EXPECT_EQ(dtype_of(name, "x"), t) << name;
    EXPECT_EQ(dtype_name(t), name);
  }
  for (const char* bad : {"float16", "f32", "FP32", "", "auto"}) {
    EXPECT_NE(error_of([&] { dtype_of(bad, "run.yaml: model.dtype"); })
                  .find(std::string("run.yaml: model.dtype: expected fp32, bf16 or fp16, got '") +
                        bad + "'"),
              std::string::npos)
        << bad;
  }
  EXPECT_NE(error_of([&] { dtype_name(at::kDouble); }).find("has no lvx name"), std::string::npos);
}

}  // namespace
}  // namespace lvx::runtime
