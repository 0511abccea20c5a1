#include "src/planner/cluster_config.h"

#include <sstream>

#include "src/common/error.h"
#include "src/planner/model_yaml.h"
#include "src/planner/yaml_fields.h"

namespace lvx::planner {

const AttentionThroughput& ClusterConfig::attention_for(const std::string& dtype) const {
  auto it = attention.find(dtype);
  LVX_CHECK(it != attention.end(), "cluster '", name, "': attention_tflops.", dtype,
            ": missing (the model's dtype; pass --dtype to plan with another)");
  return it->second;
}

double ClusterConfig::gemm_for(const std::string& dtype) const {
  auto it = gemm_flops.find(dtype);
  LVX_CHECK(it != gemm_flops.end(), "cluster '", name, "': gemm_tflops.", dtype, ": missing");
  return it->second;
}

namespace {

Link read_link(const YamlMap& m) {
  Link l;
  l.bandwidth_bytes_per_s = m.get_double("bandwidth_gb_per_s") * 1e9;
  l.latency_s = m.get_double("latency_us") * 1e-6;
  if (m.has("sync_us")) l.sync_s = m.get_double("sync_us") * 1e-6;
  m.finish();
  return l;
}

}  // namespace

ClusterConfig load_cluster_config(const std::string& path) {
  YamlMap root = load_yaml_map(path);
  ClusterConfig c;
  c.name = root.get_string("name");
  c.device = root.get_string("device");
  c.gpus_per_node = root.get_int("gpus_per_node");
  c.nodes = root.get_int("nodes");
  // The planner walks every rank's schedule (rounds x ranks): bound the cluster before it does
  // (and before nodes x gpus_per_node can overflow).
  LVX_CHECK(c.gpus_per_node <= kMaxClusterGpus, root.where("gpus_per_node"), ": expected at most ",
            kMaxClusterGpus, ", got ", c.gpus_per_node);
  LVX_CHECK(c.nodes <= kMaxClusterGpus / c.gpus_per_node, root.where("nodes"), ": ", c.nodes,
            " nodes x ", c.gpus_per_node, " GPUs is more than the ", kMaxClusterGpus,
            " GPUs the planner plans for");
  const double memory_gib = root.get_double("device_memory_gib");
  LVX_CHECK(memory_gib <= kMaxDeviceMemoryGib, root.where("device_memory_gib"),
            ": expected at most ", kMaxDeviceMemoryGib, ", got ", memory_gib);
  c.device_memory_bytes = static_cast<int64_t>(memory_gib * (1LL << 30));
  YamlMap att = root.get_map("attention_tflops");
  for (const char* dt : {"bf16", "fp16", "fp32"}) {
    if (!att.has(dt)) continue;
    YamlMap t = att.get_map(dt);
    AttentionThroughput& a = c.attention[dt];
    a.forward_flops = t.get_double("forward") * 1e12;
    a.backward_flops = t.get_double("backward") * 1e12;
    if (t.has("forward_call_us")) a.forward_call_s = t.get_double("forward_call_us") * 1e-6;
    if (t.has("backward_call_us")) a.backward_call_s = t.get_double("backward_call_us") * 1e-6;
    if (t.has("forward_tile_us")) a.forward_tile_s = t.get_double("forward_tile_us") * 1e-6;
    if (t.has("backward_tile_us")) a.backward_tile_s = t.get_double("backward_tile_us") * 1e-6;
    if (t.has("forward_masked_tile_us"))
      a.forward_masked_tile_s = t.get_double("forward_masked_tile_us") * 1e-6;
    if (t.has("backward_masked_tile_us"))
      a.backward_masked_tile_s = t.get_double("backward_masked_tile_us") * 1e-6;
    t.finish();
  }
  att.finish();
  LVX_CHECK(!c.attention.empty(), root.where("attention_tflops"),
            ": needs at least one of bf16, fp16, fp32");
  YamlMap gemm = root.get_map("gemm_tflops");
  for (const char* dt : {"bf16", "fp16", "fp32"}) {
    if (gemm.has(dt)) c.gemm_flops[dt] = gemm.get_double(dt) * 1e12;
  }
  gemm.finish();
  c.intra_node = read_link(root.get_map("intra_node"));
  c.inter_node = read_link(root.get_map("inter_node"));
  if (root.has("memory")) {
    YamlMap mem = root.get_map("memory");
    c.memory.bandwidth_bytes_per_s = mem.get_double("bandwidth_gb_per_s") * 1e9;
    LVX_CHECK(c.memory.bandwidth_bytes_per_s > 0, mem.where("bandwidth_gb_per_s"),
              ": expected a bandwidth > 0");
    const std::string shared = mem.get_string_or("shared", "false");
    LVX_CHECK(shared == "true" || shared == "false", mem.where("shared"),
              ": expected true or false, got '", shared, "'");
    c.memory.shared = shared == "true";
    mem.finish();
  }
  if (root.has("cpu_attention"))
    for (const YamlMap& e : root.get_map_list("cpu_attention")) {
      CpuAttentionChoice ch;
      ch.skv_over_sq = e.get_double("skv_over_sq");
      ch.path = e.get_string("path");
      LVX_CHECK(ch.path == "fused" || ch.path == "gemm" || ch.path == "kernel", e.where("path"),
                ": expected fused, gemm or kernel, got '", ch.path, "'");
      if (e.has("fused_ms")) ch.fused_ms = e.get_double("fused_ms");
      if (e.has("gemm_ms")) ch.gemm_ms = e.get_double("gemm_ms");
      e.finish();
      c.cpu_attention.push_back(ch);
    }
  root.finish();
  return c;
}

std::string cluster_config_yaml(const ClusterConfig& c, const std::string& comment) {
  std::ostringstream os;
  os.precision(6);
  std::istringstream lines(comment);
  for (std::string line; std::getline(lines, line);) os << "# " << line << "\n";
  os << "name: " << c.name << "\n";
  os << "device: \"" << c.device << "\"\n";
  os << "gpus_per_node: " << c.gpus_per_node << "\n";
  os << "nodes: " << c.nodes << "\n";
  os << "device_memory_gib: " << static_cast<double>(c.device_memory_bytes) / (1LL << 30) << "\n";
  os << "attention_tflops:\n";
  for (const auto& [dt, t] : c.attention) {
    os << "  " << dt << ": {forward: " << t.forward_flops / 1e12
       << ", backward: " << t.backward_flops / 1e12;
    if (t.forward_call_s > 0)
      os << ", forward_call_us: " << t.forward_call_s * 1e6
         << ", backward_call_us: " << t.backward_call_s * 1e6;
    if (t.forward_tile_s > 0)
      os << ", forward_tile_us: " << t.forward_tile_s * 1e6
         << ", backward_tile_us: " << t.backward_tile_s * 1e6;
    if (t.forward_masked_tile_s > 0)
      os << ", forward_masked_tile_us: " << t.forward_masked_tile_s * 1e6
         << ", backward_masked_tile_us: " << t.backward_masked_tile_s * 1e6;
    os << "}\n";
  }
  os << "gemm_tflops:\n";
  for (const auto& [dt, f] : c.gemm_flops) os << "  " << dt << ": " << f / 1e12 << "\n";
  auto link = [&](const char* name, const Link& l) {
    os << name << ": {bandwidth_gb_per_s: " << l.bandwidth_bytes_per_s / 1e9
       << ", latency_us: " << l.latency_s * 1e6;
    if (l.sync_s > 0) os << ", sync_us: " << l.sync_s * 1e6;
    os << "}\n";
  };
  link("intra_node", c.intra_node);
  link("inter_node", c.inter_node);
  if (c.memory.bandwidth_bytes_per_s > 0)
    os << "memory: {bandwidth_gb_per_s: " << c.memory.bandwidth_bytes_per_s / 1e9
       << ", shared: " << (c.memory.shared ? "true" : "false") << "}\n";
  if (!c.cpu_attention.empty()) {
    os << "cpu_attention:  # per block aspect ratio, the faster CPU path measured (kernels/cpu_path.h)\n";
    for (const CpuAttentionChoice& ch : c.cpu_attention) {
      os << "  - {skv_over_sq: " << ch.skv_over_sq << ", path: " << ch.path;
      if (ch.fused_ms > 0) os << ", fused_ms: " << ch.fused_ms << ", gemm_ms: " << ch.gemm_ms;
      os << "}\n";
    }
  }
  return os.str();
}

}  // namespace lvx::planner
