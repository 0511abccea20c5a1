#include "src/serve/kv_budget.h"

#include <algorithm>
#include <cmath>
#include <cstdio>

#include "src/planner/inference_memory.h"
#include "video/decoder.h"

namespace lvx::serve {

int64_t question_kv_bytes(const ModelConfig& m, int64_t frames, int64_t prompt_tokens,
                          int64_t new_tokens, int world, int64_t elem_bytes) {
  const planner::InferenceMemory im =
      planner::inference_memory(m, planner::ParamCounts{}, frames, prompt_tokens,
                                m.visual_tokens_per_frame, new_tokens, world, elem_bytes);
  return static_cast<int64_t>(std::ceil(im.kv_cache));
}

int64_t request_frames(const std::optional<int64_t>& num_frames, const std::optional<double>& fps,
                       const std::optional<double>& start, const std::optional<double>& end,
                       const std::string& video_path, int64_t max_frames) {
  if (!fps) return std::min(num_frames.value_or(16), max_frames);
  double stop = 0;
  if (end) {
    stop = *end;
  } else if (!video_path.empty()) {
    stop = video::VideoDecoder(video_path).info().duration_seconds;
  } else {
    return max_frames;  // no file to read: the most it may sample
  }
  const double span = std::max(0.0, stop - start.value_or(0));
  return std::clamp<int64_t>(static_cast<int64_t>(std::floor(span * *fps)), 1, max_frames);
}

std::string format_bytes(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%lld bytes (%.3f GiB)", static_cast<long long>(bytes),
                static_cast<double>(bytes) / (1 << 30));
  return buf;
}

}  // namespace lvx::serve
