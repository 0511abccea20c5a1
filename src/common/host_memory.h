// How much host memory this process may still take, for refusing a job up front instead of being
// killed by the OOM killer halfway through loading (models/model.h, load_model).
#pragma once

#include <cstdint>

namespace lvx {

// The memory this process can still get, in bytes: /proc/meminfo's MemAvailable (free memory
// plus the page cache and slabs the kernel can reclaim), lowered to what the process's cgroup
// (v2: memory.max − memory.current; v1: limit_in_bytes − usage_in_bytes) allows when it has a
// limit. 0 when neither can be read (then nothing is refused).
uint64_t available_host_memory();

// Bytes as people read them ("7.4 GB", decimal).
const char* human_bytes(uint64_t bytes, char (&buf)[32]);

}  // namespace lvx
