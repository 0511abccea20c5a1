// Device identity; see device_index.h.
#include "src/common/device_index.h"

#include <ATen/detail/CUDAHooksInterface.h>

namespace lvx {

c10::Device resolve_device(const c10::Device& d) {
  if (d.is_cpu() || d.is_meta()) return c10::Device(d.type());
  if (d.has_index()) return d;
  if (d.is_cuda() && at::detail::getCUDAHooks().hasCUDA())
    return c10::Device(c10::kCUDA, at::detail::getCUDAHooks().current_device());
  return c10::Device(d.type(), 0);
}

bool same_device(const c10::Device& a, const c10::Device& b) {
  return resolve_device(a) == resolve_device(b);
}

}  // namespace lvx
