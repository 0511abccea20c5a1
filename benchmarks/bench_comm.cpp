// Communication benchmark in nccl-tests' spirit: a size sweep of ring exchange (sendrecv),
// all-to-all, all-gather and all-reduce through lvx's ProcessGroup, each checked for exact
// results first, then timed (warm-up, median of repeats). Reports algorithm bandwidth
// (bytes / time) and bus bandwidth (nccl-tests doc/PERFORMANCE.md: sendrecv 1, all-to-all and
// all-gather (n−1)/n, all-reduce 2(n−1)/n times algbw), and the per-rank bytes counted.
//   bench_comm [--nproc N] [--sizes 1K,64K,1M,16M] [--iters 20] [-o md|json]
// Run without RANK/WORLD_SIZE it starts N local ranks of itself (Gloo on CPU tensors; pass
// --cuda on a GPU build for NCCL).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>

#include "src/cli/args.h"
#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/dist/process_group.h"

using namespace lvx;

namespace {

int64_t parse_size(const std::string& s) {
  const char u = s.back();
  const int64_t mult = u == 'K' ? 1024 : u == 'M' ? 1024 * 1024 : u == 'G' ? 1024LL * 1024 * 1024 : 1;
  return std::stoll(mult == 1 ? s : s.substr(0, s.size() - 1)) * mult;
}

std::string human(double bytes) {
  char b[32];
  if (bytes >= 1 << 20) std::snprintf(b, sizeof(b), "%.0fM", bytes / (1 << 20));
  else if (bytes >= 1024) std::snprintf(b, sizeof(b), "%.0fK", bytes / 1024);
  else std::snprintf(b, sizeof(b), "%.0f", bytes);
  return b;
}

int run_rank(const cli::ArgParser& p) {
  auto pg = dist::ProcessGroup::from_env();
  const int n = pg->world_size(), r = pg->rank();
  const int iters = static_cast<int>(p.get_int("iters"));
  const bool json = p.get("output-format") == "json";
  const auto dev = p.flag("cuda") ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  auto opts = at::TensorOptions().dtype(at::kFloat).device(dev);
  if (r == 0 && !json)
    std::printf("%-12s %8s %10s %10s %10s %12s %6s\n", "op", "size", "time us", "algbw GB/s",
                "busbw GB/s", "sent/rank", "wrong");
  for (const std::string op : {"sendrecv", "all_to_all", "all_gather", "all_reduce"}) {
    for (const auto& size_s : p.get_list("sizes")) {
      const int64_t bytes = parse_size(size_s);           // per-rank buffer size
      const int64_t elems = std::max<int64_t>(n, bytes / 4 / n * n);
      at::Tensor x = at::arange(elems, opts) + r * 1000.0f;
      std::function<at::Tensor()> run;
      double bus_factor = 1;
      if (op == "sendrecv") {
        at::Tensor recv = at::empty_like(x);
        run = [&, recv]() mutable { pg->ring_exchange(x, recv).wait(); return recv; };
      } else if (op == "all_to_all") {
        std::vector<int64_t> splits(n, elems / n);
        run = [&, splits] { return pg->all_to_all(x, splits, splits); };
        bus_factor = (n - 1.0) / n;
      } else if (op == "all_gather") {
        run = [&] { return pg->all_gather(x); };
        bus_factor = (n - 1.0) / n;
      } else {
        run = [&] { at::Tensor y = x.clone(); pg->all_reduce(y); return y; };
        bus_factor = 2.0 * (n - 1) / n;
      }
      // Correctness first (known answers), then timing.
      at::Tensor got = run().cpu();
      at::Tensor base = at::arange(elems, at::kFloat);
      at::Tensor want;
      if (op == "sendrecv") want = base + ((r + n - 1) % n) * 1000.0f;
      else if (op == "all_to_all") {
        std::vector<at::Tensor> parts;
        for (int j = 0; j < n; ++j) parts.push_back(base.narrow(0, r * (elems / n), elems / n) + j * 1000.0f);
        want = at::cat(parts);
      } else if (op == "all_gather") {
        std::vector<at::Tensor> parts;
        for (int j = 0; j < n; ++j) parts.push_back(base + j * 1000.0f);
        want = at::cat(parts);
      } else want = base * n + 1000.0f * n * (n - 1) / 2;
      const int64_t wrong = got.ne(want).sum().item<int64_t>();
      for (int i = 0; i < 2; ++i) run();
      std::vector<double> times;
      pg->counters().reset();
      for (int i = 0; i < iters; ++i) {
        pg->barrier();
        auto t0 = std::chrono::steady_clock::now();
        run();
        if (dev.is_cuda()) at::empty({1}, opts).cpu();  // ordered after the op's stream work
        times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      // The slowest rank's median is the operation's time.
      at::Tensor t = at::full({1}, [&] { std::sort(times.begin(), times.end()); return times[times.size() / 2]; }(),
                              at::kDouble);
      pg->all_reduce(t, dist::ReduceOp::kMax);
      const double secs = t.item<double>();
      const double algbytes = op == "all_gather" ? static_cast<double>(elems) * 4 * n : elems * 4.0;
      const double algbw = algbytes / secs / 1e9;
      const double sent = static_cast<double>(pg->counters().total_sent()) / iters;
      if (r == 0) {
        if (json) {
          nlohmann::json j{{"op", op}, {"bytes", elems * 4}, {"ranks", n}, {"time_us", secs * 1e6},
                           {"algbw_GBps", algbw}, {"busbw_GBps", algbw * bus_factor},
                           {"bytes_sent_per_rank", sent}, {"wrong", wrong}};
          std::cout << j.dump() << std::endl;
        } else {
          std::printf("%-12s %8s %10.1f %10.3f %10.3f %12s %6lld\n", op.c_str(),
                      human(elems * 4.0).c_str(), secs * 1e6, algbw, algbw * bus_factor,
                      human(sent).c_str(), static_cast<long long>(wrong));
        }
      }
      if (wrong) return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  cli::ArgParser p("bench_comm [--nproc N] [--sizes 1K,64K,1M,16M] [--iters 20] [-o md|json]",
                   "Ring exchange, all-to-all, all-gather and all-reduce bandwidth through lvx's\n"
                   "ProcessGroup, checked for exact results before timing.");
  p.add_option("nproc", 'n', "2", "local ranks to start (when not launched already)");
  p.add_option("sizes", 's', "1K,64K,1M,16M", "per-rank buffer sizes");
  p.add_option("iters", 0, "20", "timed repetitions (median reported)");
  p.add_option("output-format", 'o', "md", "md | json (one JSON line per measurement)");
  p.add_flag("cuda", 0, "use CUDA tensors (NCCL) instead of CPU tensors (Gloo)");
  try {
    if (!p.parse(argc, argv)) return 0;
    const int rc = dist::relaunch_self_as_ranks(static_cast<int>(p.get_int("nproc")), argc, argv);
    return rc >= 0 ? rc : run_rank(p);
  } catch (const std::exception& e) {
    std::cerr << "bench_comm: error: " << e.what() << "\n";
    return 1;
  }
}
