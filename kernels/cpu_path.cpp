#include "kernels/cpu_path.h"

#include <cmath>
#include <cstdlib>
#include <memory>
#include <mutex>

#include "src/common/error.h"

namespace lvx::kernels {
namespace {

std::mutex g_mu;
std::shared_ptr<const std::vector<CpuPathChoice>> g_choices =
    std::make_shared<std::vector<CpuPathChoice>>();

// LVX_CPU_ATTENTION, read once: the path for every block, or none.
const CpuPath* env_override() {
  static const std::unique_ptr<CpuPath> path = []() -> std::unique_ptr<CpuPath> {
    const char* e = std::getenv("LVX_CPU_ATTENTION");
    if (e == nullptr || *e == '\0') return nullptr;
    return std::make_unique<CpuPath>(cpu_path_from_name(e, "LVX_CPU_ATTENTION"));
  }();
  return path.get();
}

}  // namespace

const char* cpu_path_name(CpuPath p) {
  switch (p) {
    case CpuPath::kFused:
      return "fused";
    case CpuPath::kGemm:
      return "gemm";
    case CpuPath::kKernel:
      return "kernel";
  }
  return "?";
}

CpuPath cpu_path_from_name(const std::string& name, const std::string& what) {
  if (name == "fused") return CpuPath::kFused;
  if (name == "gemm") return CpuPath::kGemm;
  if (name == "kernel") return CpuPath::kKernel;
  LVX_FAIL(what, ": expected fused, gemm or kernel, got '", name, "'");
}

void set_cpu_attention_choices(std::vector<CpuPathChoice> choices) {
  for (const CpuPathChoice& c : choices)
    LVX_CHECK(c.skv_over_sq > 0 && std::isfinite(c.skv_over_sq),
              "cpu_attention: skv_over_sq must be a positive number, got ", c.skv_over_sq);
  auto table = std::make_shared<const std::vector<CpuPathChoice>>(std::move(choices));
  std::lock_guard<std::mutex> lock(g_mu);
  g_choices = std::move(table);
}

CpuPath cpu_attention_path(at::ScalarType dtype, int64_t sq, int64_t skv) {
  if (dtype == at::kDouble) return CpuPath::kKernel;
  if (const CpuPath* p = env_override()) return *p;
  std::shared_ptr<const std::vector<CpuPathChoice>> table;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    table = g_choices;
  }
  if (table->empty() || sq <= 0 || skv <= 0) return CpuPath::kFused;
  const double ratio = std::log(static_cast<double>(skv) / static_cast<double>(sq));
  const CpuPathChoice* best = &table->front();
  for (const CpuPathChoice& c : *table)
    if (std::abs(std::log(c.skv_over_sq) - ratio) < std::abs(std::log(best->skv_over_sq) - ratio))
      best = &c;
  return best->path;
}

}  // namespace lvx::kernels
