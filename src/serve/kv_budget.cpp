#include "src/serve/kv_budget.h"

#include <cmath>
#include <cstdio>

#include "src/planner/inference_memory.h"

namespace lvx::serve {

int64_t question_kv_bytes(const ModelConfig& m, int64_t frames, int64_t prompt_tokens,
                          int64_t new_tokens, int world, int64_t elem_bytes) {
  const planner::InferenceMemory im =
      planner::inference_memory(m, planner::ParamCounts{}, frames, prompt_tokens,
                                m.visual_tokens_per_frame, new_tokens, world, elem_bytes);
  return static_cast<int64_t>(std::ceil(im.kv_cache));
}

std::string format_bytes(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%lld bytes (%.3f GiB)", static_cast<long long>(bytes),
                static_cast<double>(bytes) / (1 << 30));
  return buf;
}

}  // namespace lvx::serve
