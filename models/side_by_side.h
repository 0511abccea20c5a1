// Two independent parts of a forward on two host threads (lvx serve's rows step: each layer's
// visual keys beside the prompt and the rows' own keys, models/mplug_owl3/decode.cpp). On one
// CPU thread a step of the tiny models is mostly the fixed cost of many small ATen calls (~5 us
// each, docs/serve.md), which intra-op threads cannot split; two calls on two threads can overlap.
// On a GPU the host-side cost of the launches overlaps the same way, on the caller's stream.
#pragma once

#include <c10/core/Device.h>

#include <functional>

namespace lvx::models {

// Runs `side` on ATen's inter-op pool (at::launch: the caller's grad mode and other thread-local
// state travel with it; on an accelerator the caller's current stream too) while the caller
// runs `here`; returns when both have. An exception of either is rethrown after both ended (the
// caller's first). Both run on the caller, in turn, unless `overlap`.
void side_by_side(bool overlap, const c10::Device& device, const std::function<void()>& side,
                  const std::function<void()>& here);

}  // namespace lvx::models
