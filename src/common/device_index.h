// Device identity: which device an at::Device names once its index is resolved. A device written
// without an index ("cuda", what `at::Device("cuda")` and LVX_TEST_DEVICE=cuda give) means the
// current device of its type, while a tensor always reports an indexed one ("cuda:0"); c10's
// operator== compares the fields as written, so `Device("cuda") != Device("cuda:0")` even when
// they are the same GPU. Every comparison of a requested device with a tensor's device goes
// through same_device() (tests/test_kernels_device.cpp, DeviceIndex.*, checks it without a GPU).
#pragma once

#include <c10/core/Device.h>

namespace lvx {

// `d` with its index filled in: CPU and meta as index-less devices (tensors there report none);
// an unindexed CUDA device as the current CUDA device when CUDA is usable here, else index 0
// (what the first use would make current); an indexed device unchanged.
c10::Device resolve_device(const c10::Device& d);

// Whether `a` and `b` name the same device once both are resolved.
bool same_device(const c10::Device& a, const c10::Device& b);

}  // namespace lvx
