// The NCCL engine for CUDA tensors (c10d's ProcessGroupNCCL), created when lvx is built with
// CUDA and a GPU is visible; otherwise nullptr and CUDA tensors are refused with a clear error.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

#include "src/dist/rendezvous.h"

namespace lvx::dist {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RendezvousInfo& info,
                                                    std::chrono::milliseconds timeout);

}  // namespace lvx::dist
