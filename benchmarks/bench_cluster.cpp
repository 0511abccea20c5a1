// Time on an emulated cluster (src/dist/emulated_cluster.h): this machine's ranks as 2 nodes of 2
// ranks whose links are slowed to a target cluster's FLOP-per-byte ratio (--emulate), measured
// side by side with the cost model's prediction for the same emulated cluster (a cluster config
// `lvx calibrate --nodes` measures on it first). Sections (--sections, a comma list):
//   xattn    LV-XAttn against ring, striped, ulysses and all_gather on cross-attention,
//            forward+backward, at LV-XAttn Tables 3-4's Sq:Skv proportions scaled down; the
//            measured speedup of lv_xattn over ring beside the predicted one, and its trend as
//            Skv/Sq grows (each strategy's output first checked against single-device attention)
//   overlap  each ring strategy's time over max(its compute alone, its communication alone):
//            1.0 is perfect overlap. Compute alone is the time not spent blocked on messages;
//            communication alone replays the strategy's own message schedule, round by round,
//            with no compute, on the same links
//   burst    BurstAttention's double ring against a flat ring on causal self-attention across
//            the emulated nodes: time and inter-node bytes, measured and predicted
// The planner's regret on emulated clusters is `lvx bench-plan --grid` with the same link
// options (docs/cluster.md), and the end-to-end runs are `lvx launch --emulate` of `lvx qa` and
// `lvx finetune`; docs/cluster.md gives the commands.
//
//   bench_cluster [--emulate configs/clusters/a100_80g_16.yaml] [--nproc 4 --nodes 2]
//                 [--sq 256,1024] [--skv 8192,16384,32768] [--heads 8] [--kv-heads 2]
//                 [--head-dim 64] [--reps 2] [--sections xattn,overlap,burst] [--json F]
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "kernels/attention.h"
#include "src/attention/strategy.h"
#include "src/cli/args.h"
#include "src/common/error.h"
#include "src/dist/emulated_cluster.h"
#include "src/dist/launcher.h"
#include "src/planner/cluster_config.h"
#include "src/planner/cost_model.h"
#include "src/planner/emulation.h"

using namespace lvx;
namespace fs = std::filesystem;
using attention::StrategyKind;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::vector<int64_t> ints(const std::string& s) {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');)
    if (!x.empty()) v.push_back(std::stoll(x));
  return v;
}

// ---- on the ranks --------------------------------------------------------------------------

attention::AttentionSpec cross_spec(int64_t sq, int64_t skv, const cli::ArgParser& p) {
  attention::AttentionSpec s;
  s.sq = sq;
  s.skv = skv;
  s.hq = p.get_int("heads");
  s.hkv = p.get_int("kv-heads");
  s.head_dim = p.get_int("head-dim");
  return s;
}

// The strategy's own message schedule replayed round by round with no compute (every rank's
// schedule is known to every rank, so each posts the receives the others' sends need): the
// communication alone. A message spanning several rounds (the double ring's inter-node hop) is
// waited for at the end of its span.
double replay(dist::ProcessGroup& pg, const attention::Strategy& st,
              const attention::AttentionSpec& s, bool backward) {
  const int n = pg.world_size(), r = pg.rank();
  std::vector<attention::PassSchedule> all;
  for (int j = 0; j < n; ++j) all.push_back(st.schedule(s, n, j, at::kFloat, backward));
  const int rounds = static_cast<int>(all[0].rounds.size()) + 1;
  std::vector<std::pair<int, dist::Work>> inflight;  // (last round, work)
  std::vector<at::Tensor> keep;
  pg.barrier();
  const double t0 = now_s();
  for (int t = 0; t < rounds; ++t) {
    std::vector<dist::P2POp> ops;
    int last = t;
    for (int j = 0; j < n; ++j)
      for (const attention::Message& m : all[j].messages) {
        if (m.round != t || m.peer < 0 || m.sent <= 0) continue;
        if (j == r) {
          keep.push_back(at::empty({m.sent}, at::kByte));
          ops.push_back(dist::P2POp::send(keep.back(), m.peer));
          last = std::max(last, t + m.span - 1);
        } else if (m.peer == r) {
          keep.push_back(at::empty({m.sent}, at::kByte));
          ops.push_back(dist::P2POp::recv(keep.back(), j));
          last = std::max(last, t + m.span - 1);
        }
      }
    if (!ops.empty()) inflight.emplace_back(last, pg.batch_isend_irecv(std::move(ops), "replay"));
    for (auto& [due, w] : inflight)
      if (due == t && w.valid()) w.wait();
  }
  for (auto& [due, w] : inflight)
    if (w.valid()) w.wait();
  const double mine = now_s() - t0;
  at::Tensor slowest = at::full({1}, mine, at::kDouble);
  pg.all_reduce(slowest, dist::ReduceOp::kMax);
  return slowest.item<double>();
}

// One strategy on one shape: checked against single-device attention of this rank's queries,
// then `reps` timed forward+backward steps. Rank 0 prints one JSON line.
void time_strategy(dist::ProcessGroup& pg, const attention::AttentionSpec& s, StrategyKind kind,
                   const std::string& section, int reps, bool replay_comm) {
  const int n = pg.world_size(), r = pg.rank();
  auto st = attention::make_strategy(kind);
  try {
    st->check_supported(s, n);
  } catch (const lvx::Error&) {
    return;  // e.g. ulysses with heads that do not divide by the ranks
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor q = at::randn({1, s.sq, s.hq, s.head_dim}, gen);
  const at::Tensor k = at::randn({1, s.skv, s.hkv, s.head_dim}, gen);
  const at::Tensor v = at::randn({1, s.skv, s.hkv, s.head_dim}, gen);
  const at::Tensor dout = at::randn({1, s.sq, s.hq, s.head_dim}, gen);
  const auto ql = st->q_layout(s, n), kl = st->kv_layout(s, n);
  attention::LocalInputs in{ql.shard(q, 1, r), kl.shard(k, 1, r), kl.shard(v, 1, r), {}};
  // Correctness first: this rank's rows against one device's attention over every key.
  auto out = st->forward(pg, s, in, nullptr);
  const auto ref = kernels::attention_forward(
      in.q, k, v, attention::block_params(s, in.mask, ql.positions(r), at::arange(s.skv)));
  at::Tensor err =
      at::full({1}, in.q.size(1) ? (out.o.to(at::kFloat) - ref.o).abs().max().item<double>() : 0.0,
               at::kDouble);
  pg.all_reduce(err, dist::ReduceOp::kMax);
  std::vector<double> tf, tb, wait, busy;
  int64_t sent = 0, inter = 0;
  const int node = pg.info().local_world_size;
  for (int it = 0; it < reps; ++it) {
    pg.barrier();
    pg.counters().reset();
    const double t0 = now_s();
    attention::SavedState saved;
    out = st->forward(pg, s, in, &saved);
    const double t1 = now_s();
    st->backward(pg, s, in.mask, saved, ql.shard(dout, 1, r));
    const double t2 = now_s();
    tf.push_back(t1 - t0);
    tb.push_back(t2 - t1);
    wait.push_back(pg.counters().wait_seconds);
    busy.push_back(t2 - t0 - pg.counters().wait_seconds);  // this rank's time not blocked
    sent = pg.counters().total_sent();
    inter = pg.counters().sent_inter_node(r, node);
  }
  // The slowest rank sets the pace; the busiest rank's unblocked time is the compute (with the
  // host's work of posting and copying) that communication has to hide behind.
  at::Tensor t = at::tensor({median(tf), median(tb), median(wait), static_cast<double>(sent),
                             static_cast<double>(inter), median(busy)},
                            at::kDouble);
  pg.all_reduce(t, dist::ReduceOp::kMax);
  const double comm = replay_comm ? replay(pg, *st, s, false) + replay(pg, *st, s, true) : 0;
  if (r != 0) return;
  std::cout << nlohmann::json{{"section", section},
                              {"sq", s.sq},
                              {"skv", s.skv},
                              {"mask", s.mask == kernels::MaskKind::kCausal ? "causal" : "none"},
                              {"node_size", s.node_size},
                              {"strategy", st->name()},
                              {"fwd_s", t[0].item<double>()},
                              {"bwd_s", t[1].item<double>()},
                              {"wait_s", t[2].item<double>()},
                              {"bytes_sent", t[3].item<double>()},
                              {"inter_node_bytes", t[4].item<double>()},
                              {"comm_alone_s", comm},
                              {"compute_s", t[5].item<double>()},
                              {"max_err", err.item<double>()}}
                   .dump()
            << std::endl;
}

int run_rank(const cli::ArgParser& p) {
  auto pg = dist::ProcessGroup::from_env();
  const int reps = static_cast<int>(p.get_int("reps", 1, 100));
  const std::string sections = p.get("sections");
  const bool xattn = sections.find("xattn") != std::string::npos;
  const bool overlap = sections.find("overlap") != std::string::npos;
  if (xattn || overlap)
    for (int64_t sq : ints(p.get("sq")))
      for (int64_t skv : ints(p.get("skv"))) {
        const attention::AttentionSpec s = cross_spec(sq, skv, p);
        for (StrategyKind kind :
             {StrategyKind::kRing, StrategyKind::kLvXAttn, StrategyKind::kStriped,
              StrategyKind::kUlysses, StrategyKind::kAllGather}) {
          if (!xattn && kind != StrategyKind::kLvXAttn && kind != StrategyKind::kRing &&
              kind != StrategyKind::kStriped)
            continue;
          const bool ring_like = kind == StrategyKind::kLvXAttn || kind == StrategyKind::kRing ||
                                 kind == StrategyKind::kStriped;
          time_strategy(*pg, s, kind, "xattn", reps, overlap && ring_like);
        }
      }
  if (sections.find("burst") != std::string::npos) {
    const int64_t len = p.get_int("burst-tokens");
    attention::AttentionSpec s = cross_spec(len, len, p);
    s.mask = kernels::MaskKind::kCausal;
    for (int64_t node_size : {int64_t{0}, int64_t{pg->info().local_world_size}}) {
      s.node_size = node_size;  // 0: one flat ring; the node size: the double ring
      time_strategy(*pg, s, StrategyKind::kRing, "burst", reps, true);
    }
  }
  pg->barrier();
  return 0;
}

// ---- the driver ----------------------------------------------------------------------------

std::string lvx_binary(const cli::ArgParser& p) {
  if (!p.get("lvx").empty()) return p.get("lvx");
  const fs::path self = fs::path(dist::self_executable()).parent_path();
  for (const fs::path& c : {self / "lvx", self.parent_path() / "lvx"})
    if (fs::exists(c)) return c.string();
  LVX_FAIL("bench_cluster: no lvx binary beside ", self.string(), " or one folder up (--lvx)");
}

std::string exact(double bytes_per_s) {  // a rate as tc takes it, to the bit
  return std::to_string(static_cast<int64_t>(bytes_per_s * 8)) + "bit";
}

int run_command(const std::string& cmd, std::string* out) {
  FILE* f = ::popen((cmd + " 2>&1").c_str(), "r");
  LVX_CHECK(f != nullptr, "bench_cluster: cannot run ", cmd);
  char buf[4096];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) out->append(buf, got);
  const int st = ::pclose(f);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 128;
}

struct Row {
  nlohmann::json m;        // the ranks' measurement
  double predicted_s = 0;  // the cost model's forward+backward on the calibrated cluster
  double predicted_bytes = 0;
};

planner::LayerWorkload workload(const nlohmann::json& m, const cli::ArgParser& p) {
  planner::LayerWorkload w;
  const bool causal = m["mask"] == "causal";
  w.kind = causal ? planner::LayerKind::kSelf : planner::LayerKind::kCross;
  w.sq = m["sq"].get<int64_t>();
  w.skv = m["skv"].get<int64_t>();
  w.heads = p.get_int("heads");
  w.kv_heads = p.get_int("kv-heads");
  w.head_dim = p.get_int("head-dim");
  w.hidden_size = w.heads * w.head_dim;
  w.mask = causal ? planner::MaskRule::kCausal : planner::MaskRule::kNone;
  w.elem_bytes = 4;
  w.dtype = "fp32";
  return w;
}

Row predict(const nlohmann::json& m, const cli::ArgParser& p, const planner::ClusterConfig& c,
            int n) {
  planner::CostOptions opt;
  opt.train = true;
  opt.recompute_cross_kv = false;  // attention alone
  opt.topology_aware_ring = m["node_size"].get<int64_t>() > 0 || m["section"] != "burst";
  const auto cost = planner::estimate(
      attention::strategy_from_name(m["strategy"].get<std::string>()), workload(m, p), c, n, opt);
  return {m, cost.fwd_s + cost.bwd_s, cost.bytes_sent.forward + cost.bytes_sent.backward};
}

void print_xattn(const std::vector<Row>& rows, std::ostream& os) {
  os << "\n### Cross-attention, forward+backward (measured / predicted)\n\n"
     << "| Sq | Skv | Skv/Sq | strategy | measured s | predicted s | meas/pred | MB sent/rank | "
        "max err |\n|---|---|---|---|---|---|---|---|---|\n";
  for (const Row& r : rows) {
    if (r.m["section"] != "xattn") continue;
    const double meas = r.m["fwd_s"].get<double>() + r.m["bwd_s"].get<double>();
    os << "| " << r.m["sq"] << " | " << r.m["skv"] << " | "
       << r.m["skv"].get<double>() / r.m["sq"].get<double>() << " | "
       << r.m["strategy"].get<std::string>() << " | " << std::setprecision(3) << meas << " | "
       << r.predicted_s << " | " << meas / r.predicted_s << " | "
       << r.m["bytes_sent"].get<double>() / 1e6 << " | " << r.m["max_err"].get<double>() << " |\n";
  }
  os << "\n### LV-XAttn over ring: speedup as Skv/Sq grows\n\n"
     << "| Sq | Skv | Skv/Sq | measured | predicted | measured / predicted |\n"
     << "|---|---|---|---|---|---|\n";
  for (const Row& ring : rows) {
    if (ring.m["section"] != "xattn" || ring.m["strategy"] != "ring") continue;
    for (const Row& lv : rows)
      if (lv.m["section"] == "xattn" && lv.m["strategy"] == "lv_xattn" &&
          lv.m["sq"] == ring.m["sq"] && lv.m["skv"] == ring.m["skv"]) {
        const double mr = ring.m["fwd_s"].get<double>() + ring.m["bwd_s"].get<double>();
        const double ml = lv.m["fwd_s"].get<double>() + lv.m["bwd_s"].get<double>();
        const double sm = mr / ml, sp = ring.predicted_s / lv.predicted_s;
        os << "| " << ring.m["sq"] << " | " << ring.m["skv"] << " | "
           << ring.m["skv"].get<double>() / ring.m["sq"].get<double>() << " | "
           << std::setprecision(3) << sm << "x | " << sp << "x | " << sm / sp << " |\n";
      }
  }
}

void print_overlap(const std::vector<Row>& rows, std::ostream& os) {
  os << "\n### Overlap: time / max(compute alone, communication alone) (1.0 = perfect)\n\n"
     << "| Sq | Skv | strategy | time s | compute alone s | communication alone s | ratio |\n"
     << "|---|---|---|---|---|---|---|\n";
  for (const Row& r : rows) {
    if (r.m["comm_alone_s"].get<double>() <= 0) continue;
    const double t = r.m["fwd_s"].get<double>() + r.m["bwd_s"].get<double>();
    const double compute = r.m["compute_s"].get<double>();
    const double comm = r.m["comm_alone_s"].get<double>();
    os << "| " << r.m["sq"] << " | " << r.m["skv"] << " | " << r.m["strategy"].get<std::string>()
       << (r.m["section"] == "burst"
               ? (r.m["node_size"].get<int64_t>() > 0 ? " (double ring)" : " (flat ring)")
               : "")
       << " | " << std::setprecision(3) << t << " | " << compute << " | " << comm << " | "
       << t / std::max(compute, comm) << " |\n";
  }
}

void print_burst(const std::vector<Row>& rows, std::ostream& os) {
  os << "\n### BurstAttention's double ring against a flat ring (causal self-attention)\n\n"
     << "| tokens | ring | measured s | predicted s | inter-node MB/rank (largest) |\n"
     << "|---|---|---|---|---|\n";
  for (const Row& r : rows) {
    if (r.m["section"] != "burst") continue;
    os << "| " << r.m["sq"] << " | " << (r.m["node_size"].get<int64_t>() > 0 ? "double" : "flat")
       << " | " << std::setprecision(3) << r.m["fwd_s"].get<double>() + r.m["bwd_s"].get<double>()
       << " | " << r.predicted_s << " | " << r.m["inter_node_bytes"].get<double>() / 1e6 << " |\n";
  }
}

int run_driver(const cli::ArgParser& p, int argc, char** argv) {
  const int nproc = static_cast<int>(p.get_int("nproc", 2, 64));
  const int nodes = static_cast<int>(p.get_int("nodes", 2, nproc));
  LVX_CHECK(nproc % nodes == 0, "--nodes must divide --nproc");
  const fs::path dir =
      p.get("workdir").empty()
          ? fs::temp_directory_path() / ("lvx_bench_cluster_" + std::to_string(getpid()))
          : fs::path(p.get("workdir"));
  fs::create_directories(dir);
  // 1. The emulated cluster's rates, once: every launch below shapes its links the same.
  const planner::ClusterConfig target = planner::load_cluster_config(p.get("emulate"));
  const planner::Emulation e =
      planner::emulate_cluster(target, planner::rank_attention_flops(nproc));
  std::cerr << "bench_cluster: " << e.summary << "\n";
  // 2. What the cost model is told: `lvx calibrate` on that emulated cluster.
  const std::string cal = (dir / "calibrated.yaml").string();
  std::string log;
  const std::string cmd = lvx_binary(p) + " calibrate --nproc " + std::to_string(nproc) +
                          " --nodes " + std::to_string(nodes) + " --inter-node " +
                          exact(e.rates.inter_node_bytes_per_s) + " --intra-node " +
                          exact(e.rates.intra_node_bytes_per_s) + " --output " + cal;
  std::cerr << "bench_cluster: " << cmd << "\n";
  LVX_CHECK(run_command(cmd, &log) == 0, "bench_cluster: lvx calibrate failed:\n", log);
  const planner::ClusterConfig cluster = planner::load_cluster_config(cal);
  // 3. The measurements, on ranks of the emulated cluster.
  dist::LaunchOptions o;
  o.nproc = nproc;
  o.nodes = nodes;
  o.capture = true;
  o.links = e.rates;
  o.env = {{"LVX_BENCH_CLUSTER_RANK", "1"}};
  std::vector<std::string> cmdline{dist::self_executable()};
  for (int i = 1; i < argc; ++i) cmdline.push_back(argv[i]);
  std::cerr << "bench_cluster: measuring on " << nodes << " emulated nodes x " << nproc / nodes
            << " ranks\n";
  const dist::LaunchResult res = dist::launch_local(cmdline, o);
  if (res.exit_code != 0) {
    for (const auto& rk : res.ranks) std::cerr << "[rank " << rk.rank << "] " << rk.output;
    LVX_FAIL("bench_cluster: a rank failed (", dist::describe_exit(res.exit_code), ")");
  }
  std::vector<Row> rows;
  std::stringstream out(res.ranks[0].output);
  for (std::string line; std::getline(out, line);)
    if (!line.empty() && line[0] == '{')
      rows.push_back(predict(nlohmann::json::parse(line), p, cluster, nproc));
  std::ostringstream md;
  md << "bench_cluster: " << e.summary << "\ncalibrated on it: inter_node "
     << cluster.inter_node.bandwidth_bytes_per_s / 1e6 << " MB/s per node, intra_node "
     << cluster.intra_node.bandwidth_bytes_per_s / 1e6 << " MB/s, attention "
     << cluster.attention_for("fp32").forward_flops / 1e9 << " GFLOP/s forward (fp32)\n";
  print_xattn(rows, md);
  print_overlap(rows, md);
  print_burst(rows, md);
  std::cout << md.str();
  if (!p.get("json").empty()) {
    nlohmann::json j = nlohmann::json::array();
    for (const Row& r : rows) {
      nlohmann::json x = r.m;
      x["predicted_s"] = r.predicted_s;
      x["predicted_bytes"] = r.predicted_bytes;
      j.push_back(x);
    }
    std::ofstream(p.get("json")) << nlohmann::json{{"emulation", e.summary}, {"rows", j}}.dump(2)
                                 << "\n";
  }
  if (p.get("workdir").empty()) fs::remove_all(dir);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  cli::ArgParser p(
      "bench_cluster [--emulate C.yaml] [--nproc 4 --nodes 2] [--sq L] [--skv L] "
      "[--sections S] [--json F]",
      "Strategies measured on an emulated cluster beside the cost model's prediction "
      "(docs/cluster.md).");
  p.add_option("emulate", 0, std::string(LVX_SOURCE_DIR) + "/configs/clusters/a100_80g_16.yaml",
               "the cluster whose FLOP-per-byte ratio the links get");
  p.add_option("nproc", 'n', "4", "local ranks");
  p.add_option("nodes", 0, "2", "emulated nodes");
  p.add_option("sq", 0, "256,1024", "query tokens (comma list)");
  p.add_option("skv", 0, "8192,16384,32768", "key/value tokens (comma list)");
  p.add_option("heads", 0, "8", "query heads");
  p.add_option("kv-heads", 0, "4",
               "key/value heads (GQA as mPLUG-Owl3; ulysses needs them to divide by the ranks)");
  p.add_option("head-dim", 0, "64", "head dimension");
  p.add_option("burst-tokens", 0, "8192", "tokens of the burst section's causal self-attention");
  p.add_option("reps", 'r', "2", "timed steps per strategy (median)");
  p.add_option("sections", 0, "xattn,overlap,burst", "xattn, overlap, burst (comma list)");
  p.add_option("json", 'j', "", "write every row as JSON here");
  p.add_option("lvx", 0, "", "the lvx binary (default: beside this one, or one folder up)");
  p.add_option("workdir", 0, "", "keep the calibrated cluster config here");
  try {
    if (!p.parse(argc, argv)) return 0;
    if (std::getenv("LVX_BENCH_CLUSTER_RANK")) return run_rank(p);
    return run_driver(p, argc, argv);
  } catch (const std::exception& ex) {
    std::cerr << "bench_cluster: error: " << ex.what() << "\n";
    return 1;
  }
}
