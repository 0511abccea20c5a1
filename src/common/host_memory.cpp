#include "src/common/host_memory.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>

namespace lvx {
namespace {

// The first number in a file (a cgroup value), or max() for "max" and anything unreadable.
uint64_t read_number(const std::string& path) {
  std::ifstream f(path);
  std::string s;
  if (!(f >> s) || s == "max") return std::numeric_limits<uint64_t>::max();
  try {
    return std::stoull(s);
  } catch (...) {
    return std::numeric_limits<uint64_t>::max();
  }
}

// What this process's cgroups allow it still (the least of them), max() without a limit: v2's
// memory.max − memory.current (at /sys/fs/cgroup, or /sys/fs/cgroup/unified on hybrid hosts) and
// v1's memory controller (limit_in_bytes − usage_in_bytes).
uint64_t cgroup_room() {
  constexpr uint64_t kNone = std::numeric_limits<uint64_t>::max();
  auto room = [&](const std::string& limit_file, const std::string& usage_file) {
    const uint64_t limit = read_number(limit_file), usage = read_number(usage_file);
    if (limit == kNone || limit >= (uint64_t{1} << 60)) return kNone;  // no limit
    return usage == kNone || usage >= limit ? uint64_t{0} : limit - usage;
  };
  std::ifstream f("/proc/self/cgroup");
  std::string line;
  uint64_t best = kNone;
  while (std::getline(f, line)) {
    const size_t a = line.find(':'), b = line.find(':', a + 1);
    if (a == std::string::npos || b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1), path = line.substr(b + 1);
    if (controllers.empty()) {  // v2
      for (const std::string root : {"/sys/fs/cgroup", "/sys/fs/cgroup/unified"})
        best = std::min(best, room(root + path + "/memory.max", root + path + "/memory.current"));
    } else if (("," + controllers + ",").find(",memory,") != std::string::npos) {
      const std::string d = "/sys/fs/cgroup/memory" + path;
      best = std::min(best, room(d + "/memory.limit_in_bytes", d + "/memory.usage_in_bytes"));
    }
  }
  return best;
}

}  // namespace

uint64_t available_host_memory() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  uint64_t kb = 0, avail = 0;
  std::string unit;
  while (f >> key >> kb) {
    std::getline(f, unit);
    if (key == "MemAvailable:") {
      avail = kb * 1024;
      break;
    }
  }
  const uint64_t room = cgroup_room();
  if (avail == 0) return room == std::numeric_limits<uint64_t>::max() ? 0 : room;
  return std::min(avail, room);
}

const char* human_bytes(uint64_t bytes, char (&buf)[32]) {
  const double b = static_cast<double>(bytes);
  if (b >= 1e9)
    std::snprintf(buf, sizeof buf, "%.1f GB", b / 1e9);
  else
    std::snprintf(buf, sizeof buf, "%.0f MB", b / 1e6);
  return buf;
}

}  // namespace lvx
