#include "src/planner/inference_memory.h"

#include <algorithm>
#include <sstream>

#include "src/common/error.h"

namespace lvx::planner {

InferenceMemory inference_memory(const ModelConfig& m, const ParamCounts& pc, int64_t frames,
                                 int64_t text_tokens, int64_t tokens_per_frame,
                                 int64_t new_tokens, int64_t ranks, int64_t elem_bytes) {
  LVX_CHECK(ranks >= 1, "inference memory: ranks must be >= 1, got ", ranks);
  const double e = static_cast<double>(elem_bytes), n = static_cast<double>(ranks);
  const double v_rank = static_cast<double>(frames) * static_cast<double>(tokens_per_frame) / n;
  const double l_rank = static_cast<double>(text_tokens) / n;
  const double g = static_cast<double>(new_tokens);
  InferenceMemory t;
  t.weights = e * static_cast<double>(pc.total);
  t.visual = v_rank * e *
             static_cast<double>(m.visual_feature_dim + 3 * m.vision.hidden_size +
                                 2 * m.vision.mlp_size);
  double largest = 0;
  for (const auto& l : m.layers) {
    const double kv = static_cast<double>(l.kv_heads * l.head_dim);
    if (l.kind == LayerKind::kSelf) {
      t.kv_cache += (l_rank + g) * 2 * kv * e;
      const double h = static_cast<double>(l.hidden_size), mlp = static_cast<double>(l.mlp_size);
      const double q = static_cast<double>(l.heads * l.head_dim);
      largest = std::max(largest, l_rank * (3 * h + 2 * mlp + q + 2 * kv) * e);
    } else {
      t.kv_cache += v_rank * 2 * kv * e;
    }
  }
  t.activations = largest;
  t.logits = 8 * static_cast<double>(pc.vocab);
  t.total = t.weights + t.visual + t.kv_cache + t.activations + t.logits;
  return t;
}

nlohmann::json to_json(const InferenceMemory& t) {
  return {{"weights_bytes", t.weights},         {"visual_bytes", t.visual},
          {"kv_cache_bytes", t.kv_cache},       {"activations_bytes", t.activations},
          {"logits_bytes", t.logits},           {"total_bytes", t.total}};
}

std::string format_memory(const InferenceMemory& t) {
  auto gib = [](double b) {
    std::ostringstream s;
    s.precision(3);
    s << b / double(int64_t{1} << 30) << " GiB";
    return s.str();
  };
  std::ostringstream os;
  os << "inference memory per rank: weights " << gib(t.weights) << ", visual features and encode "
     << gib(t.visual) << ", KV cache " << gib(t.kv_cache) << ", prefill transient "
     << gib(t.activations) << ", logits " << gib(t.logits) << "; peak " << gib(t.total)
     << " (the process's libraries on top)\n";
  return os.str();
}

}  // namespace lvx::planner
