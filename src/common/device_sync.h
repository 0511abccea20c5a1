// Waiting for a device: the one way lvx's timers wait for the work a device has queued before they
// read the clock (bench_kernels, calibrate, the attention and forward jobs' step times). CUDA
// kernels run asynchronously, so a timer that does not wait measures the host's launches only.
//
// It goes through c10's per-device-type guard (DeviceGuardImplInterface::synchronizeDevice), which
// libc10_cuda registers when it is loaded, so it needs no CUDA headers and no LVX_WITH_CUDA define
// and a file compiled without them still waits (a define-guarded copy in bench_kernels compiled as
// a no-op and reported 26 µs for a 160 µs kernel on the H200; the rates it printed exceeded any
// GPU's peak). CPU and meta have nothing queued: a no-op there.
#pragma once

#include <c10/core/Device.h>

namespace lvx {

// Blocks until every stream of `device` has finished its queued work; returns at once on the CPU
// and on meta.
void synchronize(const c10::Device& device);

}  // namespace lvx
