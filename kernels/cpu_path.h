// Which implementation serves a CPU attention block of bf16/fp16/fp32 (fp64 always takes lvx's
// own tiled kernels, the exact reference path):
//   fused   ATen's fused op through the fused plan (attention_fused.h), the default;
//   gemm    lvx's GEMM formulation (attention_gemm.h: matmuls per key chunk, fused softmax);
//   kernel  lvx's own tiled kernels (attention_{fwd,bwd}_cpu.cpp).
// Chosen per block shape from measurement: `lvx calibrate` times the fused and GEMM paths
// (forward + backward) at blocks of several aspect ratios Skv/Sq and records, per ratio, the
// faster in the cluster config it writes (`cpu_attention`, src/planner/cluster_config.h). A job
// that plans with that config (`--strategies auto` with `--cluster`, parallel.cluster) applies
// it (set_cpu_attention_choices); each block then takes the choice measured at the nearest ratio
// (in log scale). LVX_CPU_ATTENTION=fused|gemm|kernel overrides the choice for every block.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>
#include <vector>

namespace lvx::kernels {

enum class CpuPath { kFused, kGemm, kKernel };

const char* cpu_path_name(CpuPath p);
// "fused" | "gemm" | "kernel"; errors name `what`.
CpuPath cpu_path_from_name(const std::string& name, const std::string& what);

struct CpuPathChoice {
  double skv_over_sq = 1;
  CpuPath path = CpuPath::kFused;
};

// Process-wide; empty (the default) means fused everywhere. Safe to call while other threads
// run attention (they see the old or the new table).
void set_cpu_attention_choices(std::vector<CpuPathChoice> choices);

// The path of one block of sq queries and skv keys.
CpuPath cpu_attention_path(at::ScalarType dtype, int64_t sq, int64_t skv);

}  // namespace lvx::kernels
