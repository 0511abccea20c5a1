// NCCL through c10d: point-to-point grouped with start/endCoalescing on NCCL's own stream; a
// Work's wait() makes the caller's current stream wait on it with an event (no host sync).
#include "src/dist/nccl_backend.h"

#ifdef LVX_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace lvx::dist {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RendezvousInfo& info,
                                                    std::chrono::milliseconds timeout) {
#ifdef LVX_WITH_CUDA
  if (c10::cuda::device_count() == 0) return {};
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(info.local_rank % c10::cuda::device_count()));
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("lvx/nccl", store);
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, info.rank, info.world_size, opts);
#else
  (void)store;
  (void)info;
  (void)timeout;
  return {};
#endif
}

}  // namespace lvx::dist
