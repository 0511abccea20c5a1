// The NCCL engine for CUDA tensors (c10d's ProcessGroupNCCL), created when lvx is built with
// CUDA and each local rank has a GPU of its own; otherwise nullptr, and CUDA tensors go through
// Gloo staged in host memory (ranks sharing one GPU, which NCCL refuses; LVX_DIST_CUDA_ENGINE=gloo
// forces it).
//
// Waiting never blocks the host (torch 2.11, ProcessGroupNCCL.hpp, WorkNCCL::wait): a wait
// *with* a timeout blocks the CPU thread until the GPU finished the work, so a ring hop could not
// overlap the next block's compute. lvx instead waits with nccl_stream_wait(): the caller's
// current CUDA stream waits on the work's end event and the host goes on. Timeouts come from the
// engine's own watchdog, set to lvx's Options::timeout (LVX_DIST_TIMEOUT_S): a work that does not
// finish in time is marked failed and its communicator aborted (TORCH_NCCL_ASYNC_ERROR_HANDLING=2,
// CleanUpOnly, set unless the user chose a mode), so the next wait or post on the group throws
// and ProcessGroup::fail names the operation and the rank that stopped, within one timeout.
#pragma once

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "src/dist/rendezvous.h"

namespace lvx::dist {

// One NCCL process group over all ranks, its keys under `prefix` in `store` (each communicator
// lvx makes has a prefix of its own). The communicator is created now, collectively (every rank
// constructs its ProcessGroup at the same point, in the same order of groups), not on the first
// message: lazy creation from threads or messages whose order differs between ranks could
// deadlock.
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RendezvousInfo& info,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& prefix = "lvx/nccl");

// True when the run spans several nodes of info.local_world_size ranks each (consecutive ranks
// share a node, as launchers number them): inter-node pairs then get a communicator, hence a
// NCCL stream, of their own, so a double ring's inter-node hop overlaps its intra-node hops.
bool spans_nodes(const RendezvousInfo& info);

// Makes the caller's current CUDA stream wait for an NCCL work (an event wait; the host does not
// block). Throws c10::Error when the engine found the work failed or timed out.
void nccl_stream_wait(c10d::Work& work);

}  // namespace lvx::dist
