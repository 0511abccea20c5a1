// `lvx calibrate`: measures this machine (attention and matmul throughput per dtype, ring-step
// latency and bandwidth between N local ranks through the communication layer) and writes a
// cluster config that `lvx plan` reads. The ranks are this executable re-launched through the
// local launcher in a hidden worker mode (--comm-worker).
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "src/cli/args.h"
#include "src/cli/command.h"
#include "src/common/dtype.h"
#include "src/common/error.h"
#include "src/common/files.h"
#include "src/dist/launcher.h"
#include "src/planner/calibrate.h"
#include "src/runtime/device.h"

#ifdef LVX_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace {

using lvx::planner::ClusterConfig;

std::vector<int64_t> sweep(int64_t max_bytes) {
  std::vector<int64_t> s;
  for (int64_t b = 8; b <= max_bytes; b *= 8) s.push_back(b);
  if (s.back() != max_bytes) s.push_back(max_bytes);
  return s;
}

// One rank of the communication sweep; rank 0 writes {"sizes": [...], "seconds": [...]}.
int comm_worker(const std::string& out, int64_t max_bytes, const std::string& device, int reps) {
  auto pg = lvx::dist::ProcessGroup::from_env();
  const at::Device dev = lvx::runtime::choose_device(device);  // cuda:LOCAL_RANK or cpu
  std::vector<int64_t> sizes = sweep(max_bytes);
  std::vector<double> sec = lvx::planner::measure_ring_steps(*pg, sizes, dev, reps);
  // A blocking collective right after compute (ulysses' all-to-alls): 10 ms of matmuls first.
  const double collective =
      lvx::planner::measure_collective_after_compute(*pg, dev, std::max(reps, 9), 0.01);
  if (pg->rank() == 0) {
    std::ofstream f(out);
    f << nlohmann::json{{"sizes", sizes},
                        {"seconds", sec},
                        {"collective_after_compute", collective}}
             .dump()
      << "\n";
    LVX_CHECK(f.good(), "calibrate worker: cannot write '", out, "'");
  }
  pg->barrier();
  return 0;
}

int cmd_calibrate(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx calibrate [--nproc N] [--device auto|cuda|cpu] [--output C.yaml]",
      "Measure this machine's attention throughput (forward, backward) and matmul throughput per\n"
      "dtype, and the latency and bandwidth of a ring step between N local ranks, and write a\n"
      "cluster config for `lvx plan`. One machine: intra_node is measured, inter_node repeats it.");
  lvx::cli::add_nproc_options(p, "2", "local ranks for the communication sweep");
  lvx::cli::add_threads_option(p);
  lvx::cli::add_device_option(p);
  p.add_option("name", 0, "local", "name of the cluster config");
  p.add_option("output", 'o', "", "write the cluster config here (default: stdout only)");
  p.add_option("seq", 0, "512", "tokens of the attention problem timed (queries = keys)");
  p.add_option("heads", 0, "8", "heads of the attention problem timed");
  p.add_option("head-dim", 0, "64", "head dimension of the attention problem timed");
  p.add_option("max-bytes", 0, "16777216", "largest ring message of the sweep");
  p.add_option("reps", 'r', "5", "timed repetitions per measurement (median)");
  p.add_option("comm-worker", 0, "", "internal: run one rank of the sweep, rank 0 writes here");
  if (!p.parse(argc, argv)) return 0;
  const int reps = static_cast<int>(p.get_int("reps", 1, 100000));
  if (!p.get("comm-worker").empty()) {
    return comm_worker(p.get("comm-worker"), p.get_int("max-bytes"), p.get("device"), reps);
  }
  const int nproc = lvx::cli::checked_nproc(p);
  LVX_CHECK(nproc >= 2, "--nproc: the sweep needs at least 2 ranks, got ", nproc);
  // This process times on local rank 0's device; the sweep's ranks each take their own.
  const std::string spec = p.get("device");
  const at::Device dev = lvx::runtime::choose_device(
      spec, 0, nproc, spec == "cpu" ? 0 : lvx::runtime::cuda_device_count());
  if (!p.get("output").empty()) lvx::check_output_path(p.get("output"), "--output");
  for (const char* flag : {"seq", "heads", "head-dim"}) p.get_int(flag, 1, 1 << 20);
  p.get_int("max-bytes", 1, int64_t{1} << 34);

  ClusterConfig c;
  c.name = p.get("name");
  c.gpus_per_node = nproc;
  c.nodes = 1;
  std::vector<at::ScalarType> dtypes = {at::kFloat};
  if (dev.is_cuda()) dtypes = {at::kBFloat16, at::kHalf, at::kFloat};
  std::ostringstream log;
  for (at::ScalarType dt : dtypes) {
    const std::string name = lvx::dtype_name(dt);
    std::cerr << "calibrate: timing attention and matmul in " << name << " on " << dev << "\n";
    // On CPU each rank gets cores / nproc intra-op threads (the launcher's OMP_NUM_THREADS), and
    // with more ranks than cores they share the cores: measure what one rank gets.
    const long cores = lvx::cli::available_cores();
    const int threads = dev.is_cuda() ? 0
                        : p.get("threads") != "auto"
                            ? static_cast<int>(p.get_int("threads", 1, 4096))
                            : static_cast<int>(std::max<long>(1, cores / nproc));
    const double share = dev.is_cuda() ? 1.0 : std::min(1.0, double(cores) / nproc);
    auto s = lvx::planner::measure_throughput(dt, dev, p.get_int("seq"), p.get_int("heads"),
                                              p.get_int("head-dim"), 1024, reps, threads, share);
    const lvx::planner::AttentionThroughput& a = c.attention[name] = s.attention;
    c.gemm_flops[name] = s.gemm_flops;
    log << name << ": attention forward " << s.forward_s * 1e3 << " ms, backward "
        << s.backward_s * 1e3 << " ms for seq " << p.get("seq") << " x heads " << p.get("heads")
        << " x dim " << p.get("head-dim") << " (" << threads << " threads, share " << share
        << " of them); fitted per call " << a.forward_call_s * 1e6 << " / "
        << a.backward_call_s * 1e6 << " us, per tile and head " << a.forward_tile_s * 1e6 << " / "
        << a.backward_tile_s * 1e6 << " us, per partly masked tile "
        << a.forward_masked_tile_s * 1e6 << " / " << a.backward_masked_tile_s * 1e6
        << " us (forward / backward)\n";
  }
  if (dev.is_cuda()) {
#ifdef LVX_WITH_CUDA
    const cudaDeviceProp* prop = at::cuda::getDeviceProperties(dev.index());
    c.device = prop->name;
    c.device_memory_bytes = static_cast<int64_t>(prop->totalGlobalMem);
#endif
  } else {
    c.device = "cpu";
    const double ram = double(sysconf(_SC_PHYS_PAGES)) * double(sysconf(_SC_PAGE_SIZE));
    c.device_memory_bytes = static_cast<int64_t>(ram / nproc);  // the ranks share the host
  }

  std::string tmp = (std::filesystem::temp_directory_path() /
                     ("lvx_calibrate_" + std::to_string(getpid()) + ".json"))
                        .string();
  lvx::dist::LaunchOptions lo;
  lo.nproc = nproc;
  lo.capture = true;
  lo.timeout_s = 300;
  std::cerr << "calibrate: ring-step sweep on " << nproc << " local ranks\n";
  auto r = lvx::dist::launch_local(
      {lvx::dist::self_executable(), "calibrate", "--comm-worker", tmp, "--max-bytes",
       p.get("max-bytes"), "--device", p.get("device"), "--reps", p.get("reps")},
      lo);
  if (r.exit_code != 0) {
    for (const auto& rk : r.ranks) std::cerr << "[rank " << rk.rank << "] " << rk.output;
    LVX_FAIL("calibrate: communication sweep failed (rank ", r.first_failed, " ",
             lvx::dist::describe_exit(r.exit_code), ")");
  }
  nlohmann::json j;
  {
    std::ifstream f(tmp);
    LVX_CHECK(f.good(), "calibrate: the sweep wrote no result to '", tmp, "'");
    f >> j;
  }
  std::filesystem::remove(tmp);
  std::vector<int64_t> sizes = j["sizes"].get<std::vector<int64_t>>();
  std::vector<double> sec = j["seconds"].get<std::vector<double>>();
  c.intra_node = lvx::planner::fit_link(sizes, sec);
  const double collective = j["collective_after_compute"].get<double>();
  // Where ranks share cores, a collective after compute waits for peers' time slices.
  c.intra_node.sync_s = std::max(0.0, collective - c.intra_node.latency_s);
  c.inter_node = c.intra_node;
  log << "all_to_all right after 10 ms of compute: " << collective * 1e6 << " us (sync_us: the "
      << "part above the latency)\n";
  log << "ring step (send to next, receive from previous), " << nproc << " ranks:\n";
  for (size_t i = 0; i < sizes.size(); ++i) {
    log << "  " << sizes[i] << " B: " << sec[i] * 1e6 << " us (" << double(sizes[i]) / sec[i] / 1e9
        << " GB/s)\n";
  }
  std::string yaml = lvx::planner::cluster_config_yaml(
      c, "written by `lvx calibrate --nproc " + std::to_string(nproc) + " --device " +
             p.get("device") + "`\n" + log.str() +
             "one machine: inter_node repeats the measured intra_node link");
  std::cout << yaml;
  if (!p.get("output").empty()) {
    std::ofstream f(p.get("output"));
    f << yaml;
    LVX_CHECK(f.good(), "--output: cannot write '", p.get("output"), "'");
  }
  return 0;
}

}  // namespace

LVX_COMMAND("calibrate", "measure this machine and write a cluster config for lvx plan",
            cmd_calibrate);
