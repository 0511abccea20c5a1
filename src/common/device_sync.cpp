// Waiting for a device; see device_sync.h.
#include "src/common/device_sync.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "src/common/device_index.h"

namespace lvx {

void synchronize(const c10::Device& device) {
  if (device.is_cpu() || device.is_meta()) return;
  const c10::Device d = resolve_device(device);
  c10::impl::getDeviceGuardImpl(d.type())->synchronizeDevice(d.index());
}

}  // namespace lvx
