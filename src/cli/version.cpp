#include "src/cli/version.h"

#include <torch/headeronly/version.h>

#include <sstream>

#include "lvx_version.h"
#include "src/cli/args.h"
#include "src/runtime/device.h"

#ifdef LVX_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <cuda_runtime_api.h>
#endif

namespace lvx::cli {

namespace {

// The CUDA toolkit lvx was compiled with and the GPUs it sees (names where CUDA is compiled in).
std::string cuda_text() {
  std::ostringstream os;
#ifdef LVX_WITH_CUDA
  int runtime = 0;
  cudaRuntimeGetVersion(&runtime);
  os << "CUDA " << CUDART_VERSION / 1000 << "." << (CUDART_VERSION % 1000) / 10 << " (runtime "
     << runtime / 1000 << "." << (runtime % 1000) / 10 << ")";
  const int gpus = runtime::cuda_device_count();
  os << "; " << gpus << (gpus == 1 ? " GPU" : " GPUs");
  for (int i = 0; i < gpus; ++i)
    os << (i ? ", " : ": ") << "cuda:" << i << " " << at::cuda::getDeviceProperties(i)->name;
#else
  os << "CUDA not compiled in (CPU only)";
#endif
  return os.str();
}

}  // namespace

std::string version_text() {
  std::ostringstream os;
  os << "lvx " << LVX_VERSION << " (commit " << LVX_GIT_COMMIT << ")\n"
     << "libtorch " << TORCH_VERSION << "; " << cuda_text() << "\n"
     << "cpu: " << available_cores() << " cores for this process, native bf16 products: "
     << (runtime::cpu_computes_bf16() ? "yes" : "no") << "\n";
  return os.str();
}

}  // namespace lvx::cli
