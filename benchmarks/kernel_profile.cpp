// bench_kernels --profile (benchmarks/kernel_profile.h): PyTorch's own profiler, called as
// torch.profiler calls it (torch/csrc/autograd/profiler_kineto.h: prepareProfiler,
// enableProfiler, disableProfiler, ProfilerResult::save).
#include "benchmarks/kernel_profile.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <utility>

#include <torch/csrc/autograd/profiler_kineto.h>

#include "kernels/attention.h"
#include "src/common/device_sync.h"
#include "src/common/dtype.h"
#include "src/common/error.h"

namespace lvx::bench {
namespace {

namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Measured {
  double wall_s = 0, launch_s = 0;  // all iterations
  std::unique_ptr<prof::ProfilerResult> result;
};

Measured measure(const ProfiledCall& c, const at::Device& dev, int iters) {
  std::set<ActivityType> acts{ActivityType::CPU};
  if (dev.is_cuda()) acts.insert(ActivityType::CUDA);
  const ProfilerConfig config(ProfilerState::KINETO, /*report_input_shapes=*/true);
  prof::prepareProfiler(config, acts);
  prof::enableProfiler(config, acts);
  Measured m;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) c.run();
  m.launch_s = seconds_since(t0);
  lvx::synchronize(dev);
  m.wall_s = seconds_since(t0);
  m.result = prof::disableProfiler();
  return m;
}

// Events by name, total ns and count: device kernels (events on a non-CPU device) or host
// operators (nested ones counted in their callers too).
std::vector<std::pair<std::string, std::pair<double, int>>> events_of(
    const prof::ProfilerResult& r, bool device) {
  std::map<std::string, std::pair<double, int>> by_name;
  for (const auto& e : r.events()) {
    if ((e.deviceType() == c10::DeviceType::CPU) == device) continue;
    auto& [ns, n] = by_name[e.name()];
    ns += static_cast<double>(e.durationNs());
    ++n;
  }
  std::vector<std::pair<std::string, std::pair<double, int>>> v(by_name.begin(), by_name.end());
  std::sort(v.begin(), v.end(),
            [](const auto& a, const auto& b) { return a.second.first > b.second.first; });
  return v;
}

std::string short_name(const std::string& s) {
  return s.size() <= 60 ? s : s.substr(0, 57) + "...";
}

void print_events(const std::vector<std::pair<std::string, std::pair<double, int>>>& events,
                  double total_ns, int iters, size_t top) {
  char line[256];
  for (size_t i = 0; i < std::min(top, events.size()); ++i) {
    const auto& [name, v] = events[i];
    std::snprintf(line, sizeof line, "    %8.1f us x%-3d %5.1f%%  %s", v.first / 1e3 / iters,
                  v.second / std::max(iters, 1), total_ns > 0 ? 100.0 * v.first / total_ns : 0.0,
                  short_name(name).c_str());
    std::cout << line << "\n";
  }
}

void print_summary(const std::string& tag, const ProfiledCall& c, const Measured& m, int iters) {
  const auto kernels = events_of(*m.result, true), host = events_of(*m.result, false);
  double kernel_ns = 0;
  for (const auto& k : kernels) kernel_ns += k.second.first;
  char line[256];
  std::snprintf(line, sizeof line,
                "profile %s %-6s per call: wall %.1f us, host launch %.1f us, kernels %.1f us "
                "(%zu kinds)",
                tag.c_str(), c.name.c_str(), 1e6 * m.wall_s / iters, 1e6 * m.launch_s / iters,
                kernel_ns / 1e3 / iters, kernels.size());
  std::cout << line << "\n  device kernels (share of kernel time):\n";
  print_events(kernels, kernel_ns, iters, 12);
  std::cout << "  host operators (share of wall; callers include their callees):\n";
  print_events(host, 1e9 * m.wall_s, iters, 12);
}

}  // namespace

void profile_calls(const std::string& dir, const std::string& tag,
                   const std::vector<ProfiledCall>& calls, const at::Device& device, int warmup,
                   int iters) {
  LVX_CHECK(iters > 0, "--profile: needs at least one repeat");
  std::filesystem::create_directories(dir);
  for (const auto& c : calls) {
    for (int i = 0; i < warmup; ++i) c.run();
    lvx::synchronize(device);
    Measured m = measure(c, device, iters);
    m.result->save((std::filesystem::path(dir) / (tag + "-" + c.name + ".json")).string());
    print_summary(tag, c, m, iters);
  }
}

void profile_attention(const std::string& dir, const at::Device& device, at::ScalarType dtype,
                       int64_t sq, int64_t skv, int64_t heads, int64_t hkv, int64_t dim, int warmup,
                       int iters) {
  using namespace lvx::kernels;
  const auto opts = at::TensorOptions().dtype(dtype).device(device);
  const auto q = at::randn({1, sq, heads, dim}, opts), k = at::randn({1, skv, hkv, dim}, opts);
  const auto v = at::randn({1, skv, hkv, dim}, opts), dout = at::randn({1, sq, heads, dim}, opts);
  const auto qh = q.transpose(1, 2).contiguous(), doh = dout.transpose(1, 2).contiguous();
  const auto kh = k.repeat_interleave(heads / hkv, 2).transpose(1, 2).contiguous();
  const auto vh = v.repeat_interleave(heads / hkv, 2).transpose(1, 2).contiguous();
  const AttentionParams p;
  const AttentionOutput out = attention_forward(q, k, v, p);
  const at::Tensor delta = attention_delta(dout, out.o);
  std::vector<ProfiledCall> calls{
      {"lvx", [&] { attention_forward(q, k, v, p); }},
      {"lvx-bwd", [&] { attention_backward(q, k, v, dout, out.lse, delta, p); }}};
  const bool flash = device.is_cuda() && (dtype == at::kBFloat16 || dtype == at::kHalf);
  if (flash) {
    const auto f = at::_scaled_dot_product_flash_attention(qh, kh, vh);
    calls.push_back({"flash", [&] { at::_scaled_dot_product_flash_attention(qh, kh, vh); }});
    calls.push_back({"flash-bwd", [&, f] {
                       at::_scaled_dot_product_flash_attention_backward(
                           doh, qh, kh, vh, std::get<0>(f), std::get<1>(f), std::get<2>(f),
                           std::get<3>(f), std::get<4>(f).expect_int(),
                           std::get<5>(f).expect_int(), 0.0, false, std::get<6>(f),
                           std::get<7>(f));
                     }});
  } else {
    calls.push_back({"sdpa", [&] { at::scaled_dot_product_attention(qh, kh, vh); }});
  }
  std::ostringstream tag;
  tag << device.type() << "-" << lvx::dtype_name(dtype) << "-" << sq << "x" << skv << "-h"
      << heads << "-hkv" << hkv << "-d" << dim;
  profile_calls(dir, tag.str(), calls, device, warmup, iters);
}

}  // namespace lvx::bench
