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
#include "src/cli/cluster_options.h"
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

// One rank of the communication sweep; rank 0 writes {"sizes", "seconds",
// "collective_after_compute"} for one node, and over `nodes` nodes also "intra" and "inter":
// pair exchanges inside each node (local ranks 2i and 2i+1) and between nodes (each rank with the
// same local rank of the next node, all at once: a node's ranks share its link).
int comm_worker(const std::string& out, int64_t max_bytes, int64_t intra_max_bytes,
                const std::string& device, int reps) {
  auto pg = lvx::dist::ProcessGroup::from_env();
  const at::Device dev = lvx::runtime::choose_device(device);  // cuda:LOCAL_RANK or cpu
  const int n = pg->world_size(), r = pg->rank();
  const int local = pg->info().local_world_size, node = r / local, l = r % local;
  std::vector<int64_t> sizes = sweep(max_bytes);
  nlohmann::json j;
  if (local < n) {
    const int intra_peer = (l ^ 1) < local ? node * local + (l ^ 1) : -1;
    const std::vector<int64_t> intra_sizes = sweep(intra_max_bytes);
    j["intra"] = {
        {"sizes", intra_sizes},
        {"seconds", lvx::planner::measure_pair_exchanges(*pg, intra_peer, intra_sizes, dev, reps)},
        {"flows_per_link", 1}};
    const int nodes = n / local;
    const int inter_peer = nodes == 2      ? (r + local) % n
                           : node % 2 == 0 ? (node + 1 < nodes ? r + local : -1)
                                           : r - local;
    j["inter"] = {
        {"sizes", sizes},
        {"seconds", lvx::planner::measure_pair_exchanges(*pg, inter_peer, sizes, dev, reps)},
        {"flows_per_link", local}};
  } else {
    j["sizes"] = sizes;
    j["seconds"] = lvx::planner::measure_ring_steps(*pg, sizes, dev, reps);
  }
  // A blocking collective right after compute (ulysses' all-to-alls): 10 ms of matmuls first.
  j["collective_after_compute"] =
      lvx::planner::measure_collective_after_compute(*pg, dev, std::max(reps, 9), 0.01);
  if (r == 0) {
    std::ofstream f(out);
    f << j.dump() << "\n";
    LVX_CHECK(f.good(), "calibrate worker: cannot write '", out, "'");
  }
  pg->barrier();
  return 0;
}

// The CPU attention path per block shape (kernels/cpu_path.h): the fused and GEMM paths timed
// forward+backward on square, 8:1 and 64:1 blocks of the same size (a self-attention block, a
// cross block, a few queries against many keys), with one rank's threads; the faster per shape.
std::vector<lvx::planner::CpuAttentionChoice> choose_cpu_attention(const lvx::cli::ArgParser& p,
                                                                   int nproc, std::ostream& log) {
  const int threads =
      p.get("threads") != "auto"
          ? static_cast<int>(p.get_int("threads", 1, 4096))
          : static_cast<int>(std::max<long>(1, lvx::cli::available_cores() / nproc));
  std::cerr << "calibrate: timing the CPU attention paths (fused, GEMM) per block shape\n";
  const auto samples =
      lvx::planner::measure_cpu_paths({{1024, 1024}, {512, 4096}, {128, 8192}}, p.get_int("heads"),
                                      p.get_int("head-dim"), 2, threads);
  const auto choices = lvx::planner::choose_cpu_paths(samples);
  for (size_t i = 0; i < samples.size(); ++i)
    log << "cpu attention " << samples[i].sq << " x " << samples[i].skv << " (fwd+bwd): fused "
        << samples[i].fused_s * 1e3 << " ms, gemm " << samples[i].gemm_s * 1e3
        << " ms: " << choices[i].path << "\n";
  return choices;
}

// The link a pair sweep measured: per flow from the samples, times the flows that shared it.
lvx::planner::Link fitted(const nlohmann::json& j) {
  auto link = lvx::planner::fit_link(j["sizes"].get<std::vector<int64_t>>(),
                                     j["seconds"].get<std::vector<double>>());
  link.bandwidth_bytes_per_s *= j.value("flows_per_link", 1);
  return link;
}

// How close the measured cluster `c` came to the one --emulate named: attention FLOP per link
// byte for both link kinds, measured against target (fp32 here, the target's bf16).
std::string emulation_check(const ClusterConfig& c, const std::string& target_path) {
  const ClusterConfig t = lvx::planner::load_cluster_config(target_path);
  const double f_here = c.attention_for("fp32").forward_flops;
  const double f_there = t.attention_for("bf16").forward_flops;
  std::ostringstream o;
  o << "emulation of " << t.name << ", attention FLOP per link byte (here / there):\n";
  for (const auto& [name, here, there] : {std::tuple{"inter_node", c.inter_node, t.inter_node},
                                          std::tuple{"intra_node", c.intra_node, t.intra_node}}) {
    const double a = f_here / here.bandwidth_bytes_per_s, b = f_there / there.bandwidth_bytes_per_s;
    o << "  " << name << ": " << a << " / " << b << " = " << a / b << "\n";
  }
  std::cerr << "calibrate: " << o.str();
  return o.str();
}

// The options of `lvx calibrate`, the hidden worker mode's included.
void add_calibrate_options(lvx::cli::ArgParser& p) {
  lvx::cli::add_nproc_options(p, "2", "local ranks for the communication sweep");
  p.add_option("nodes", 0, "1",
               "as lvx launch: the ranks as this many (emulated) nodes; intra_node and\n"
               "inter_node are then measured apart (pair exchanges inside and between nodes)");
  lvx::cli::add_link_options(p);
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
  p.add_option("intra-max-bytes", 0, "16777216",
               "internal: the intra-node sweep's largest message");
}

// What a calibration (not the worker mode) runs with: ranks, nodes, links, the timing device.
struct CalibrateJob {
  int reps = 0;
  int nproc = 0;
  int nodes = 0;
  lvx::dist::LinkRates links;
  at::Device dev{at::kCPU};
};

// The checked ranks, nodes and links, and the device this process times on.
CalibrateJob calibrate_job_of(const lvx::cli::ArgParser& p, int reps) {
  CalibrateJob job;
  job.reps = reps;
  job.nproc = lvx::cli::checked_nproc(p);
  LVX_CHECK(job.nproc >= 2, "--nproc: the sweep needs at least 2 ranks, got ", job.nproc);
  job.nodes = static_cast<int>(p.get_int("nodes", 1, job.nproc));
  LVX_CHECK(job.nproc % job.nodes == 0, "--nodes ", job.nodes, " must divide --nproc ", job.nproc);
  job.links = lvx::cli::link_rates(p, job.nproc);
  // This process times on local rank 0's device; the sweep's ranks each take their own.
  const std::string spec = p.get("device");
  job.dev = lvx::runtime::choose_device(spec, 0, job.nproc,
                                        spec == "cpu" ? 0 : lvx::runtime::cuda_device_count());
  return job;
}

// Checks --output's path and the sizes' ranges before anything is measured.
void check_calibrate_flags(const lvx::cli::ArgParser& p) {
  if (!p.get("output").empty()) lvx::check_output_path(p.get("output"), "--output");
  for (const char* flag : {"seq", "heads", "head-dim"}) p.get_int(flag, 1, 1 << 20);
  p.get_int("max-bytes", 1, int64_t{1} << 34);
}

// Times attention and matmul in each dtype of the device into c, one log line per dtype.
void time_compute(const lvx::cli::ArgParser& p, const CalibrateJob& job, ClusterConfig& c,
                  std::ostream& log) {
  const at::Device dev = job.dev;
  const int nproc = job.nproc;
  // A CPU runs fp32, and bf16 (the releases' dtype, lvx qa's --dtype auto where the CPU has
  // native bf16 products).
  std::vector<at::ScalarType> dtypes = {at::kFloat, at::kBFloat16};
  if (dev.is_cuda()) dtypes = {at::kBFloat16, at::kHalf, at::kFloat};
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
    auto s =
        lvx::planner::measure_throughput(dt, dev, p.get_int("seq"), p.get_int("heads"),
                                         p.get_int("head-dim"), 1024, job.reps, threads, share);
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
}

// The device's name and the memory one rank has of it.
void describe_device(const at::Device& dev, int nproc, ClusterConfig& c) {
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
}

// The cluster config's compute side: per-dtype throughput, the CPU attention paths, the device.
ClusterConfig measure_compute(const lvx::cli::ArgParser& p, const CalibrateJob& job,
                              std::ostream& log) {
  ClusterConfig c;
  c.name = p.get("name");
  c.gpus_per_node = job.nproc;
  c.nodes = 1;
  time_compute(p, job, c, log);
  if (!job.dev.is_cuda()) c.cpu_attention = choose_cpu_attention(p, job.nproc, log);
  describe_device(job.dev, job.nproc, c);
  // A CPU's memory is the host's, read by every local rank (all its cores: rank 0 decoding
  // alone uses them all); a GPU's is its own.
  const int cores = static_cast<int>(lvx::cli::available_cores());
  c.memory.bandwidth_bytes_per_s =
      lvx::planner::measure_read_bandwidth(job.dev, job.reps, job.dev.is_cuda() ? 0 : cores);
  c.memory.shared = !job.dev.is_cuda();
  log << "memory: read bandwidth " << c.memory.bandwidth_bytes_per_s / 1e9 << " GB/s ("
      << (c.memory.shared ? "the host's, shared by its ranks" : "each device's own") << ")\n";
  return c;
}

// Runs the communication sweep on the job's local ranks (this executable in --comm-worker mode)
// and returns what rank 0 wrote.
nlohmann::json run_comm_sweep(const lvx::cli::ArgParser& p, const CalibrateJob& job) {
  const int nproc = job.nproc, nodes = job.nodes;
  const lvx::dist::LinkRates& links = job.links;
  std::string tmp = (std::filesystem::temp_directory_path() /
                     ("lvx_calibrate_" + std::to_string(getpid()) + ".json"))
                        .string();
  lvx::dist::LaunchOptions lo;
  lo.nproc = nproc;
  lo.nodes = nodes;
  lo.capture = true;
  lo.timeout_s = 600;
  lo.links = links;
  // Over a shaped link each sweep's largest message takes about 0.3 s, not minutes.
  int64_t max_bytes = p.get_int("max-bytes"), intra_max_bytes = max_bytes;
  auto cap = [](int64_t b, double rate) {
    return rate > 0 ? std::min<int64_t>(b, std::max<int64_t>(1 << 16, rate * 0.3)) : b;
  };
  if (links.enabled()) {
    max_bytes = cap(max_bytes, links.inter_node_bytes_per_s / (nproc / nodes));
    intra_max_bytes = cap(intra_max_bytes, links.intra_node_bytes_per_s);
  }
  std::cerr << "calibrate: "
            << (nodes > 1 ? "pair exchanges inside and between " + std::to_string(nodes) + " nodes"
                          : std::string("ring-step sweep"))
            << " on " << nproc << " local ranks\n";
  auto r = lvx::dist::launch_local(
      {lvx::dist::self_executable(), "calibrate", "--comm-worker", tmp, "--max-bytes",
       std::to_string(max_bytes), "--intra-max-bytes", std::to_string(intra_max_bytes), "--device",
       p.get("device"), "--reps", p.get("reps")},
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
  return j;
}

// The intra- and inter-node links fitted from the sweep's result j (over several nodes also the
// cluster's shape), each sweep's samples logged.
void fit_links(ClusterConfig& c, nlohmann::json& j, const CalibrateJob& job, std::ostream& log) {
  const int nproc = job.nproc, nodes = job.nodes;
  const lvx::dist::LinkRates& links = job.links;
  auto sweep_log = [&](const std::string& title, const nlohmann::json& k) {
    const auto sizes = k["sizes"].get<std::vector<int64_t>>();
    const auto sec = k["seconds"].get<std::vector<double>>();
    log << title << ":\n";
    for (size_t i = 0; i < sizes.size(); ++i)
      log << "  " << sizes[i] << " B: " << sec[i] * 1e6 << " us ("
          << double(sizes[i]) / sec[i] / 1e9 << " GB/s)\n";
  };
  if (nodes > 1) {
    c.gpus_per_node = nproc / nodes;
    c.nodes = nodes;
    c.intra_node = c.gpus_per_node > 1 ? fitted(j["intra"]) : fitted(j["inter"]);
    c.inter_node = fitted(j["inter"]);
    sweep_log("pair exchange inside a node (one flow per rank's link)", j["intra"]);
    sweep_log("pair exchange between nodes (" + std::to_string(c.gpus_per_node) +
                  " flows share each node's link)",
              j["inter"]);
    if (links.enabled())
      log << "emulated links: inter-node " << lvx::dist::format_rate(links.inter_node_bytes_per_s)
          << " per node, intra-node "
          << (links.intra_node_bytes_per_s > 0
                  ? lvx::dist::format_rate(links.intra_node_bytes_per_s) + " per rank"
                  : std::string("unshaped"))
          << "\n";
  } else {
    c.intra_node = lvx::planner::fit_link(j["sizes"].get<std::vector<int64_t>>(),
                                          j["seconds"].get<std::vector<double>>());
    c.inter_node = c.intra_node;
    sweep_log(
        "ring step (send to next, receive from previous), " + std::to_string(nproc) + " ranks", j);
  }
}

// Each link's sync_s from the collective right after compute, logged.
void set_sync_costs(ClusterConfig& c, double collective, std::ostream& log) {
  // Where ranks share cores, a collective after compute waits for peers' time slices.
  c.intra_node.sync_s = std::max(0.0, collective - c.intra_node.latency_s);
  c.inter_node.sync_s = std::max(0.0, collective - c.inter_node.latency_s);
  log << "all_to_all right after 10 ms of compute: " << collective * 1e6 << " us (sync_us: the "
      << "part above the latency)\n";
}

// Prints the cluster config's YAML (the log as its comment) and writes it to --output if given.
void write_cluster_config(const lvx::cli::ArgParser& p, const ClusterConfig& c,
                          const CalibrateJob& job, const std::string& log) {
  const int nproc = job.nproc, nodes = job.nodes;
  std::string yaml = lvx::planner::cluster_config_yaml(
      c, "written by `lvx calibrate --nproc " + std::to_string(nproc) + " --nodes " +
             std::to_string(nodes) + " --device " + p.get("device") + "`\n" + log +
             (nodes > 1 ? "" : "one node: inter_node repeats the measured intra_node link"));
  std::cout << yaml;
  if (!p.get("output").empty()) {
    std::ofstream f(p.get("output"));
    f << yaml;
    LVX_CHECK(f.good(), "--output: cannot write '", p.get("output"), "'");
  }
}

int cmd_calibrate(int argc, char** argv) {
  lvx::cli::ArgParser p(
      "lvx calibrate [--nproc N] [--device auto|cuda|cpu] [--output C.yaml]",
      "Measure this machine's attention throughput (forward, backward) and matmul throughput per\n"
      "dtype, and the latency and bandwidth of a ring step between N local ranks, and write a\n"
      "cluster config for `lvx plan`. One node: intra_node is measured, inter_node repeats it;\n"
      "with --nodes K (and --inter-node/--emulate, an emulated cluster) both are measured.");
  add_calibrate_options(p);
  if (!p.parse(argc, argv)) return 0;
  const int reps = static_cast<int>(p.get_int("reps", 1, 100000));
  if (!p.get("comm-worker").empty()) {
    return comm_worker(p.get("comm-worker"), p.get_int("max-bytes"), p.get_int("intra-max-bytes"),
                       p.get("device"), reps);
  }
  const CalibrateJob job = calibrate_job_of(p, reps);
  check_calibrate_flags(p);

  std::ostringstream log;
  ClusterConfig c = measure_compute(p, job, log);
  nlohmann::json j = run_comm_sweep(p, job);
  const double collective = j["collective_after_compute"].get<double>();
  fit_links(c, j, job, log);
  if (!p.get("emulate").empty()) log << emulation_check(c, p.get("emulate"));
  set_sync_costs(c, collective, log);
  write_cluster_config(p, c, job, log.str());
  return 0;
}

}  // namespace

LVX_COMMAND("calibrate", "measure this machine and write a cluster config for lvx plan",
            cmd_calibrate);
