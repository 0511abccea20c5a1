#include "models/side_by_side.h"

#include <ATen/Parallel.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <exception>
#include <future>
#include <memory>
#include <optional>

namespace lvx::models {

void side_by_side(bool overlap, const c10::Device& device, const std::function<void()>& side,
                  const std::function<void()>& here) {
  if (!overlap) {
    side();
    here();
    return;
  }
  std::optional<c10::Stream> stream;
  if (!device.is_cpu()) stream = c10::impl::VirtualGuardImpl(device.type()).getStream(device);
  auto done = std::make_shared<std::promise<void>>();
  std::future<void> side_done = done->get_future();
  at::launch([&side, done, stream] {
    try {
      std::optional<c10::StreamGuard> on_stream;
      if (stream) on_stream.emplace(*stream);
      side();
      done->set_value();
    } catch (...) {
      done->set_exception(std::current_exception());
    }
  });
  std::exception_ptr failed;
  try {
    here();
  } catch (...) {
    failed = std::current_exception();
  }
  side_done.wait();  // `side` refers to the caller's frame: never leave before it ends
  if (failed) std::rethrow_exception(failed);
  side_done.get();
}

}  // namespace lvx::models
