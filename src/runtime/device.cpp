#include "src/runtime/device.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <iostream>
#include <cstdlib>
#include <string>

#include "src/common/error.h"

namespace lvx::runtime {

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long x = std::strtol(v, &end, 10);
  LVX_CHECK(end != v && *end == '\0' && x >= 0 && x < (1 << 20), name,
            ": expected a non-negative integer, got '", v, "'");
  return static_cast<int>(x);
}

}  // namespace

at::Device choose_device(const std::string& spec, int local_rank, int local_world, int gpus) {
  LVX_CHECK(spec == "auto" || spec == "cuda" || spec == "cpu",
            "--device: expected auto, cuda or cpu, got '", spec, "'");
  LVX_CHECK(local_world >= 1 && local_rank >= 0 && local_rank < local_world,
            "--device: local rank ", local_rank, " is outside the ", local_world, " local ranks");
  if (spec == "cpu" || (spec == "auto" && !gpus_suffice(local_world, gpus)))
    return at::Device(at::kCPU);
  LVX_CHECK(gpus > 0, "--device cuda: this machine has no CUDA device (or this lvx was built ",
            "without CUDA and its libtorch sees none); use --device cpu or auto");
  LVX_CHECK(local_world <= gpus, "--device cuda: ", local_world,
            " local ranks need one GPU each but this machine has ", gpus,
            " (CUDA_VISIBLE_DEVICES); use --nproc ", gpus, " (with torchrun, mpirun or lvx ",
            "launch: at most ", gpus, " ranks per node), or --device cpu");
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

int cuda_device_count() {
  if (!at::detail::getCUDAHooks().hasCUDA()) return 0;
  return static_cast<int>(at::detail::getCUDAHooks().deviceCount());
}

bool gpus_suffice(int local_ranks, int gpus) { return gpus > 0 && local_ranks <= gpus; }

std::string auto_device_note(int local_ranks, int gpus) {
  if (gpus <= 0 || gpus_suffice(local_ranks, gpus)) return "";
  return str("--device auto: ", local_ranks, " local ranks but ", gpus,
             " GPU(s), and ranks never share a GPU: running on the CPU (--nproc ", gpus,
             " runs on the GPUs)");
}

at::Device choose_device(const std::string& spec) {
  const int world = env_int("LOCAL_WORLD_SIZE", 1);
  const int rank = env_int("LOCAL_RANK", 0);
  // Counting devices initialises CUDA: only when asked for it (cpu never touches the driver).
  const int gpus = spec == "cpu" ? 0 : cuda_device_count();
  const at::Device d = choose_device(spec, rank, world, gpus);
  if (spec == "auto" && rank == 0)  // once per node
    if (const std::string note = auto_device_note(world, gpus); !note.empty())
      std::cerr << "lvx: " << note << "\n";
  // Through the device guard's implementation, which c10_cuda registers (what c10::DeviceGuard
  // calls): torch 2.11's CUDAHooks does not override setCurrentDevice, whose default throws
  // "Backend doesn't support setCurrentDevice()" (found by the first GPU run of lvx-gpu/run.sh).
  if (d.is_cuda()) c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(d);
  return d;
}

void check_device_option(const std::string& spec) { choose_device(spec, 0, 1, 1); }

void check_local_devices(const std::string& spec, int local_ranks) {
  choose_device(spec, 0, std::max(local_ranks, 1), spec == "cpu" ? 0 : cuda_device_count());
}

std::string resolve_dtype(const std::string& option, const at::Device& device,
                          const std::string& checkpoint_dtype) {
  LVX_CHECK(option == "fp32" || option == "bf16" || option == "auto",
            "--dtype: expected fp32, bf16 or auto, got '", option, "'");
  if (option != "auto") return option;
  if (!device.is_cuda()) return "fp32";
  return checkpoint_dtype == "float32" ? "fp32" : "bf16";
}

}  // namespace lvx::runtime
