#include "src/runtime/device.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cpuid.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <iostream>
#include <cstdlib>
#include <string>

#include "src/common/error.h"
#include "src/dist/rendezvous.h"

namespace lvx::runtime {

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

namespace {

// libtorch's CUDA half (libtorch_cuda.so and the CUDA libraries it needs: ~350 MB of resident
// pages and its kernels' registration at start) is loaded when a command first asks for CUDA on
// a machine with an NVIDIA driver, not when lvx starts: a CPU build links libtorch_cpu only
// (cmake/Libtorch.cmake), so commands that compute nothing, and ranks on a CPU, start light. Its
// static initialisers register the CUDA hooks and kernels when it loads, as for any extension
// library dlopen'ed after torch. A CUDA build links it (lvx's own kernels call it): found here
// already.
void load_cuda_runtime() {
  static const bool once = [] {
    if (at::detail::getCUDAHooks().hasCUDA()) return true;
    if (::access("/dev/nvidiactl", F_OK) != 0) return false;  // no NVIDIA driver: nothing to load
    if (::dlopen("libtorch_cuda.so", RTLD_NOW | RTLD_GLOBAL) == nullptr) {
      std::cerr << "lvx: an NVIDIA driver is present but libtorch_cuda.so could not be loaded ("
                << ::dlerror() << "): running without CUDA\n";
      return false;
    }
    return true;
  }();
  (void)once;
}

}  // namespace

int cuda_device_count() {
  load_cuda_runtime();
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
  // The local rank as torchrun, OpenMPI or Slurm set it (src/dist/rendezvous.h).
  const dist::RendezvousInfo where = dist::rendezvous_from_env();
  const int world = where.local_world_size;
  const int rank = where.local_rank;
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

bool cpu_computes_bf16() {
#if defined(__x86_64__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  const uint64_t xcr0 = (static_cast<uint64_t>(hi) << 32) | lo;
  const bool zmm_state = (xcr0 & 0xe6) == 0xe6;            // SSE, AVX, opmask, ZMM (bits 1,2,5-7)
  const bool tile_state = (xcr0 & (3u << 17)) == (3u << 17);  // AMX tile config and data
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx_bf16 = (d & (1u << 22)) && tile_state;
  bool avx512_bf16 = false;
  if (__get_cpuid_count(7, 1, &a, &b, &c, &d)) avx512_bf16 = (a & (1u << 5)) && zmm_state;
  return amx_bf16 || avx512_bf16;
#else
  return false;
#endif
}

std::string resolve_dtype(const std::string& option, const at::Device& device,
                          const std::string& checkpoint_dtype, bool cpu_bf16) {
  LVX_CHECK(option == "fp32" || option == "bf16" || option == "auto",
            "--dtype: expected fp32, bf16 or auto, got '", option, "'");
  if (option != "auto") return option;
  if (checkpoint_dtype == "float32") return "fp32";
  // A bf16 (or fp16) checkpoint: bf16 on a GPU, and on a CPU whose matrix units take bf16
  // (AMX-BF16: 3.4× its fp32 GEMM rate on the machines lvx is measured on; AVX512-BF16), where
  // it is also half the bytes of every decoded token's weight reads; fp32 on other CPUs, which
  // compute bf16 by converting it.
  return device.is_cuda() || cpu_bf16 ? "bf16" : "fp32";
}

std::string dtype_note(const std::string& option, const at::Device& device,
                       const std::string& checkpoint_dtype, const std::string& chosen) {
  if (option != "auto" || checkpoint_dtype == "float32") return "";  // no choice was made
  std::string why = device.is_cuda()
                        ? "the checkpoint's dtype"
                        : chosen == "bf16" ? "the checkpoint's dtype; this CPU computes bf16 natively"
                                           : "this CPU has no native bf16 products (AMX-BF16 or "
                                             "AVX512-BF16), so bf16 would run slower";
  return str("--dtype auto: ", chosen, " (", checkpoint_dtype, " weights; ", why, ")");
}

}  // namespace lvx::runtime
