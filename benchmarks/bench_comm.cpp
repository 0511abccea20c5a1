// Communication benchmark in nccl-tests' spirit: a size sweep of lvx's collectives, side by side in
// one run on the same ranks for each implementation (--impl, CollectiveImpl in process_group.h):
//   auto    lvx's default: NCCL's own collectives on CUDA tensors; on Gloo, Gloo's allreduce and
//           broadcast and lvx's rings for reduce_scatter and all_gather
//   engine  every collective on the engine's own algorithm (c10d: Gloo's on CPU, NCCL's on CUDA
//           tensors; src/dist/collectives.cpp), Gloo's reduce_scatter (an all-reduce narrowed to
//           each rank's chunk) and allgather included
//   p2p     every collective as lvx's rings of batched point-to-point messages, one host-driven
//           step after another (src/dist/collectives_p2p.cpp)
// plus the point-to-point operations (sendrecv, all_to_all), which have one implementation. Each
// op is checked for exact results first, on data exactly representable in fp32 (small integers,
// so that no order of summation rounds), then timed (a warm-up each, then the implementations'
// repeats interleaved, so that drift falls on all alike; the median of repeats, each repeat's time
// its slowest rank's). Reports algorithm bandwidth (bytes / time) and bus bandwidth
// (nccl-tests doc/PERFORMANCE.md: sendrecv 1, all-to-all, all-gather and reduce-scatter (n−1)/n,
// all-reduce 2(n−1)/n, broadcast 1 times algbw), the per-rank bytes counted (an engine
// collective's by its algorithm's formula: Gloo's reduce_scatter really sends twice that), and
// each implementation's time over auto's (> 1: auto faster).
//   bench_comm [--nproc N] [--sizes 1M,4M,16M,64M] [--impl auto,engine,p2p] [--iters 10]
//              [-o md|json]
// Run without RANK/WORLD_SIZE it starts N local ranks of itself (Gloo on CPU tensors; pass --cuda
// on a GPU build for NCCL); under `lvx launch --nodes K --inter-node R` it measures an emulated
// cluster.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>

#include "src/cli/args.h"
#include "src/common/error.h"
#include "src/dist/launcher.h"
#include "src/dist/process_group.h"

using namespace lvx;
using dist::P2POp;
using dist::ProcessGroup;

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

// Chunk c of n elements split over w ranks: [n·c/w, n·(c+1)/w).
at::Tensor chunk_of(const at::Tensor& flat, int c, int w) {
  const auto [b, e] = dist::shard_range(flat.numel(), w, c);
  return flat.narrow(0, b, e - b);
}

// ---- the sweep -----------------------------------------------------------------------------

struct Case {
  std::function<at::Tensor()> run;
  at::Tensor want;
  double algbytes = 0, bus_factor = 1;
};

// One op on one implementation: data exactly representable (integers below 2^12 per rank, so
// sums of up to 4096 ranks stay exact in fp32) and its known result.
Case make_case(ProcessGroup& pg, const std::string& op, const std::string& impl, int64_t elems,
               const at::TensorOptions& opts) {
  const int n = pg.world_size(), r = pg.rank();
  const at::Tensor base = at::remainder(at::arange(elems, at::kFloat), 4096.0);
  const at::Tensor x = (base + static_cast<double>(r)).to(opts.device());
  Case c;
  c.algbytes = elems * 4.0;
  if (op == "sendrecv") {
    at::Tensor recv = at::empty_like(x);
    c.run = [&pg, x, recv]() mutable { pg.ring_exchange(x, recv).wait(); return recv; };
    c.want = base + pg.prev();
  } else if (op == "all_to_all") {
    std::vector<int64_t> splits(n, elems / n);
    c.run = [&pg, x, splits] { return pg.all_to_all(x, splits, splits); };
    std::vector<at::Tensor> parts;
    for (int j = 0; j < n; ++j) parts.push_back(base.narrow(0, r * (elems / n), elems / n) + j);
    c.want = at::cat(parts);
    c.bus_factor = (n - 1.0) / n;
  } else if (op == "all_gather") {
    c.run = [&pg, x] { return pg.all_gather(x); };
    std::vector<at::Tensor> parts;
    for (int j = 0; j < n; ++j) parts.push_back(base + j);
    c.want = at::cat(parts);
    c.algbytes *= n;
    c.bus_factor = (n - 1.0) / n;
  } else if (op == "all_reduce") {
    c.run = [&pg, x] {
      at::Tensor y = x.clone();
      pg.all_reduce(y);
      return y;
    };
    c.want = base * n + n * (n - 1) / 2.0;
    c.bus_factor = 2.0 * (n - 1) / n;
  } else if (op == "reduce_scatter") {
    c.run = [&pg, x] {
      at::Tensor y = x.clone();
      return pg.reduce_scatter(y).clone();
    };
    c.want = chunk_of(base * n + n * (n - 1) / 2.0, r, n);
    c.bus_factor = (n - 1.0) / n;
  } else {  // broadcast from rank 0
    c.run = [&pg, x] {
      at::Tensor y = x.clone();
      pg.broadcast(y, 0);
      return y;
    };
    c.want = base;
  }
  return c;
}

dist::CollectiveImpl impl_of(const std::string& impl) {
  if (impl == "p2p") return dist::CollectiveImpl::kP2P;
  if (impl == "engine") return dist::CollectiveImpl::kEngine;
  LVX_CHECK(impl == "auto", "bench_comm: --impl takes auto, engine and p2p, not '", impl, "'");
  return dist::CollectiveImpl::kAuto;
}

double slowest_median(ProcessGroup& pg, std::vector<double> times) {
  std::sort(times.begin(), times.end());
  at::Tensor t = at::full({1}, times[times.size() / 2], at::kDouble);
  pg.all_reduce(t, dist::ReduceOp::kMax);
  return t.item<double>();
}

// One implementation's measurement of one op and size.
struct Timed {
  std::string impl;
  Case c;
  int64_t wrong = 0;
  std::vector<double> times;
  int64_t sent = 0;
};

// Checks every implementation's result, warms each up, then times them interleaved, repeat by
// repeat (impl A, B, C, A, B, C, ...), so that what drifts during the run (other processes, the
// allocator, the caches) falls on all of them alike.
std::vector<Timed> measure(ProcessGroup& pg, const std::string& op, int64_t elems,
                           const std::vector<std::string>& impls, int iters,
                           const at::TensorOptions& opts) {
  std::vector<Timed> ts;
  for (const std::string& impl : impls) {
    pg.set_collectives(impl_of(impl));
    Timed t;
    t.impl = impl;
    t.c = make_case(pg, op, impl, elems, opts);
    t.wrong = t.c.run().cpu().ne(t.c.want).sum().item<int64_t>();
    t.c.run();  // warm-up
    ts.push_back(std::move(t));
  }
  for (int i = 0; i < iters; ++i)
    for (Timed& t : ts) {
      pg.set_collectives(impl_of(t.impl));
      pg.barrier();
      pg.counters().reset();
      const auto t0 = std::chrono::steady_clock::now();
      t.c.run();
      if (opts.device().is_cuda()) at::empty({1}, opts).cpu();  // after the op's stream work
      t.times.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      t.sent = pg.counters().total_sent();
    }
  pg.set_collectives(dist::CollectiveImpl::kAuto);
  return ts;
}

void print_row(const std::string& op, int n, int64_t elems, const Timed& t, double secs,
               double auto_secs, bool json) {
  const double algbw = t.c.algbytes / secs / 1e9;
  const std::string vs =
      t.impl != "auto" && auto_secs > 0 ? std::to_string(secs / auto_secs).substr(0, 4) : "-";
  if (json) {
    std::cout << nlohmann::json{{"op", op}, {"impl", t.impl}, {"bytes", elems * 4}, {"ranks", n},
                                {"time_us", secs * 1e6}, {"algbw_GBps", algbw},
                                {"busbw_GBps", algbw * t.c.bus_factor},
                                {"bytes_sent_per_rank", t.sent}, {"wrong", t.wrong}}
                     .dump()
              << std::endl;
  } else {
    std::printf("| %s | %s | %s | %.1f | %.3f | %.3f | %s | %s | %lld |\n", op.c_str(),
                t.impl.c_str(), human(elems * 4.0).c_str(), secs * 1e6, algbw,
                algbw * t.c.bus_factor, human(static_cast<double>(t.sent)).c_str(), vs.c_str(),
                static_cast<long long>(t.wrong));
  }
}

int run_rank(const cli::ArgParser& p) {
  auto pg = dist::ProcessGroup::from_env();
  const int n = pg->world_size(), r = pg->rank();
  const int iters = static_cast<int>(p.get_int("iters", 1, 100000));
  const bool json = p.get("output-format") == "json";
  const auto dev = p.flag("cuda") ? at::Device(at::kCUDA) : at::Device(at::kCPU);
  const auto opts = at::TensorOptions().dtype(at::kFloat).device(dev);
  const std::vector<std::string> impls = p.get_list("impl");
  if (r == 0 && !json)
    std::printf("| op | impl | size | time us | algbw GB/s | busbw GB/s | sent/rank | time / auto's | "
                "wrong |\n|---|---|---|---|---|---|---|---|---|\n");
  for (const std::string op :
       {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "sendrecv", "all_to_all"}) {
    const bool several = op != "sendrecv" && op != "all_to_all";
    for (const auto& size_s : p.get_list("sizes")) {
      const int64_t elems = std::max<int64_t>(n, parse_size(size_s) / 4 / n * n);
      const auto ts =
          measure(*pg, op, elems, several ? impls : std::vector<std::string>{"auto"}, iters, opts);
      double auto_secs = 0;
      int64_t wrong = 0;
      for (const Timed& t : ts) {
        const double secs = slowest_median(*pg, t.times);
        if (t.impl == "auto") auto_secs = secs;
        if (r == 0) print_row(op, n, elems, t, secs, auto_secs, json);
        wrong += t.wrong;
      }
      if (wrong) return 1;
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  cli::ArgParser p("bench_comm [--nproc N] [--sizes 1M,4M,16M,64M] [--impl auto,engine,p2p] "
                   "[--iters 10] [-o md|json]",
                   "lvx's collectives on the engines' algorithms against rings of point-to-point\n"
                   "messages, side by side, checked for exact results before timing.");
  p.add_option("nproc", 'n', "2", "local ranks to start (when not launched already)");
  p.add_option("sizes", 's', "1M,4M,16M,64M", "per-rank buffer sizes");
  p.add_option("impl", 0, "auto,engine,p2p",
               "implementations of the collectives: auto (lvx's default), engine, p2p");
  p.add_option("iters", 0, "10", "timed repetitions (median reported)");
  p.add_option("output-format", 'o', "md", "md | json (one JSON line per measurement)");
  p.add_flag("cuda", 0, "use CUDA tensors (NCCL) instead of CPU tensors (Gloo)");
  try {
    if (!p.parse(argc, argv)) return 0;
    for (const auto& i : p.get_list("impl"))
      LVX_CHECK(i == "auto" || i == "engine" || i == "p2p",
                "--impl: expected auto, engine and/or p2p, got '", i, "'");
    const int rc = dist::relaunch_self_as_ranks(static_cast<int>(p.get_int("nproc")), argc, argv);
    return rc >= 0 ? rc : run_rank(p);
  } catch (const std::exception& e) {
    std::cerr << "bench_comm: error: " << e.what() << "\n";
    return 1;
  }
}
