// Cluster configs (configs/clusters/*.yaml): how many GPUs, how much memory, how fast attention
// runs per dtype, and the two link classes (inside a node, between nodes). Strict loading as in
// model_yaml.h; `lvx calibrate` writes one for the machine it runs on. Fields: docs/planner.md.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace lvx::planner {

// Achieved attention throughput in FLOP/s with the FlashAttention FLOP convention (dense
// counts; Dao 2024, LV-XAttn Table 1): forward 4·Sq·Skv·H·D, backward 10·Sq·Skv·H·D.
struct AttentionThroughput {
  double forward_flops = 0;
  double backward_flops = 0;
  // Optional, measured by `lvx calibrate` (0: not known, the nominal configs):
  // the fixed cost of one kernel call (a round's launch, allocation and merge), and the extra
  // cost of one partly masked tile of the CPU kernels' tile grid (kernels/registry.h; such a
  // tile is computed whole and then masked entry by entry, where a full tile is not masked and
  // an empty one is skipped).
  double forward_call_s = 0, backward_call_s = 0;
  double forward_tile_s = 0, backward_tile_s = 0;  // per computed tile (dispatch, copies)
  double forward_masked_tile_s = 0, backward_masked_tile_s = 0;
};

struct Link {
  double bandwidth_bytes_per_s = 0;  // one direction; for inter_node, per node (its GPUs share it)
  double latency_s = 0;              // per message
  // Extra wait of a blocking collective (all-to-all, all-gather) entered right after compute:
  // where ranks share cores (more local ranks than cores), a peer still computing holds its core
  // until its time slice ends. Measured by `lvx calibrate` (yaml sync_us, omitted when 0); 0 for
  // GPUs, where every rank owns its device. Overlapped ring hops do not pay it.
  double sync_s = 0;
};

// The memory a decode step streams its weights from (optional, yaml `memory:`): the read
// bandwidth of one device, or, where `shared` (a CPU host: every local rank reads the same
// memory), of the node. Decoding reads every weight once a token, so its time per token is about
// bytes ÷ this (src/planner/decode_price.h). 0: not known (no decode price).
struct MemoryBandwidth {
  double bandwidth_bytes_per_s = 0;
  bool shared = false;
};

// `lvx calibrate`'s choice of CPU attention path for blocks of one aspect ratio Skv/Sq
// (kernels/cpu_path.h), with the forward+backward times it measured (ms; 0 when not given).
struct CpuAttentionChoice {
  double skv_over_sq = 1;
  std::string path = "fused";  // fused | gemm | kernel
  double fused_ms = 0, gemm_ms = 0;
};

// Bounds on what a cluster config may describe (a larger value is an error naming the field).
constexpr int64_t kMaxClusterGpus = 4096;
constexpr double kMaxDeviceMemoryGib = 1 << 20;

struct ClusterConfig {
  std::string name;
  std::string device;  // free text, e.g. "A100-SXM4-80GB"
  int64_t gpus_per_node = 0;
  int64_t nodes = 0;
  int64_t device_memory_bytes = 0;
  std::map<std::string, AttentionThroughput> attention;  // by dtype (bf16, fp16, fp32)
  std::map<std::string, double> gemm_flops;              // dense matmul FLOP/s by dtype
  Link intra_node;
  Link inter_node;
  MemoryBandwidth memory;
  std::vector<CpuAttentionChoice> cpu_attention;  // optional (cpu_attention:), CPU configs only

  int64_t world_size() const { return gpus_per_node * nodes; }
  // Errors name the config and the missing dtype.
  const AttentionThroughput& attention_for(const std::string& dtype) const;
  double gemm_for(const std::string& dtype) const;
};

ClusterConfig load_cluster_config(const std::string& path);

// Writes `c` in the format load_cluster_config reads (used by `lvx calibrate`).
std::string cluster_config_yaml(const ClusterConfig& c, const std::string& comment);

}  // namespace lvx::planner
