// NCCL through c10d: point-to-point grouped with start/endCoalescing on NCCL's own stream; a
// Work's wait() makes the caller's current stream wait on it with an event (no host sync).
#include "src/dist/nccl_backend.h"

#include <cstdlib>

#ifdef LVX_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace lvx::dist {

bool spans_nodes(const RendezvousInfo& info) {
  const int l = info.local_world_size;
  return l >= 1 && l < info.world_size && info.world_size % l == 0;
}

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RendezvousInfo& info,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& prefix) {
#ifdef LVX_WITH_CUDA
  if (c10::cuda::device_count() == 0) return {};
  // Ranks sharing a GPU (more local ranks than GPUs): NCCL refuses two ranks on one device, so
  // there is no NCCL engine and CUDA tensors go through Gloo with host staging (process_group.h).
  // LVX_DIST_CUDA_ENGINE=gloo asks for the same on any machine (for tests).
  const char* engine = std::getenv("LVX_DIST_CUDA_ENGINE");
  if (engine != nullptr && std::string(engine) == "gloo") return {};
  if (info.local_world_size > c10::cuda::device_count()) return {};
  const auto dev = static_cast<c10::DeviceIndex>(info.local_rank % c10::cuda::device_count());
  c10::cuda::set_device(dev);
  // A timed-out or failed work: the watchdog aborts its communicator and marks it failed (read by
  // the next wait) instead of tearing the process down, so lvx can name the failed rank. Read by
  // ProcessGroupNCCL's constructor; a mode the user set is kept.
  setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", /*overwrite=*/0);
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;  // the watchdog's per-work deadline (not a host wait)
  opts->group_name = prefix;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>(prefix, store);
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, info.rank, info.world_size, opts);
  // Every communicator is created now, collectively (every rank of the group constructs its
  // ProcessGroup at the same point), never lazily on a first message: a lazy creation inside a
  // message that not every rank posts at the same point, or on threads whose order differs
  // between ranks (ZeRO stage 3's gather and reduction threads), could deadlock.
  pg->eagerConnectSingleDevice(at::Device(at::kCUDA, dev));
  return pg;
#else
  (void)store;
  (void)info;
  (void)timeout;
  (void)prefix;
  return {};
#endif
}

void nccl_stream_wait(c10d::Work& work) {
  // WorkNCCL::wait() without a timeout is synchronizeStream(): the current stream waits on the
  // work's end event; with TORCH_NCCL_BLOCKING_WAIT=1 set by the user it blocks, bounded by the
  // engine's timeout. Either way it rethrows the failure the watchdog recorded.
  work.wait();
}

}  // namespace lvx::dist
