#include "src/planner/question_price.h"

#include <algorithm>
#include <iomanip>
#include <sstream>

#include "src/common/error.h"
#include "src/planner/planner.h"

namespace lvx::planner {

double vision_flops_per_image(const ModelConfig& m) {
  const VisionEncoderConfig& v = m.vision;
  if (v.patch_size <= 0 || v.image_size <= 0) return 0;
  const double T = double(v.image_size / v.patch_size) * double(v.image_size / v.patch_size);
  const double h = double(v.hidden_size), mlp = double(v.mlp_size);
  const double patch = 2 * T * h * 3 * double(v.patch_size) * double(v.patch_size);
  return patch + double(v.layers) * (2 * T * (4 * h * h + 2 * h * mlp) + 4 * T * T * h);
}

namespace {

// The language model's prefill FLOPs: its layers over the prompt, the cross layers' K/V
// projections over the visual tokens.
double language_flops(const ModelConfig& m, const QuestionShape& q) {
  double flops = 2 * double(q.lm_parameters) * double(q.text_tokens);
  const double visual = double(q.frames) * double(q.tokens_per_frame);
  for (const AttentionLayerConfig& l : m.layers)
    if (l.kind == LayerKind::kCross)
      flops += 2 * visual * double(m.visual_feature_dim) * 2 * double(l.kv_heads * l.head_dim);
  return flops;
}

}  // namespace

QuestionPrice price_question(const ModelConfig& m, const ClusterConfig& c, const QuestionShape& q,
                             int64_t ranks, const CostOptions& opt) {
  QuestionPrice p;
  p.ranks = ranks;
  const bool shared = c.memory.shared;
  const double devices = shared ? double(std::max<int64_t>(1, c.gpus_per_node)) : double(ranks);
  const double rate = c.gemm_for(q.dtype) * devices;
  p.compute_s = (double(q.frames) * vision_flops_per_image(m) + language_flops(m, q)) / rate;
  Workload w;
  w.frames = q.frames;
  w.text_tokens = q.text_tokens;
  w.tokens_per_frame = q.tokens_per_frame;
  w.ranks = ranks;
  w.dtype = q.dtype;
  p.attention_s = plan(m, c, w, opt).total_s;
  if (shared && c.gpus_per_node > 0) p.attention_s *= double(ranks) / double(c.gpus_per_node);
  DecodeShape s;
  s.frames = q.frames;
  s.text_tokens = q.text_tokens;
  s.tokens_per_frame = q.tokens_per_frame;
  s.weight_bytes = q.weight_bytes;
  s.elem_bytes = dtype_bytes(q.dtype, "dtype");
  p.decode_s = price_decode(m, c, s, ranks, /*lead=*/true).total_s();
  p.total_s =
      p.compute_s + p.attention_s + double(std::max<int64_t>(0, q.new_tokens - 1)) * p.decode_s;
  return p;
}

int64_t fastest_ranks(const std::vector<QuestionPrice>& prices) {
  LVX_CHECK(!prices.empty(), "fastest_ranks: no prices");
  const QuestionPrice* best = &prices[0];
  for (const QuestionPrice& p : prices)
    if (p.total_s < best->total_s || (p.total_s == best->total_s && p.ranks < best->ranks))
      best = &p;
  return best->ranks;
}

nlohmann::json to_json(const QuestionPrice& p) {
  return {{"ranks", p.ranks},
          {"seconds", p.total_s},
          {"compute_s", p.compute_s},
          {"attention_s", p.attention_s},
          {"decode_s_per_token", p.decode_s}};
}

std::string format_question(const std::vector<QuestionPrice>& prices, int64_t new_tokens) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(2);
  for (const QuestionPrice& p : prices)
    os << "  " << p.ranks << (p.ranks == 1 ? " rank: " : " ranks: ") << p.total_s
       << " s (prefill compute " << p.compute_s << " s, attention " << p.attention_s << " s, "
       << std::max<int64_t>(0, new_tokens - 1) << " tokens x " << p.decode_s * 1e3 << " ms)\n";
  return os.str();
}

}  // namespace lvx::planner
