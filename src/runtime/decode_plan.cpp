#include "src/runtime/decode_plan.h"

#include <vector>

#include "src/planner/cluster_config.h"
#include "src/planner/decode_price.h"
#include "src/runtime/model_description.h"

namespace lvx::runtime {

std::string decode_price_text(const std::string& model_dir, const models::Model& model,
                              const PlanRequest& request, int64_t frames, int64_t text_tokens,
                              int world) {
  if (request.cluster.empty())
    return "decode per token: not priced (no --cluster; lvx calibrate writes one)\n";
  const planner::ClusterConfig cluster = planner::load_cluster_config(request.cluster);
  if (!planner::can_price_decode(cluster))
    return "decode per token: not priced (the cluster config has no memory: "
           "{bandwidth_gb_per_s}; lvx calibrate measures it)\n";
  const planner::ModelConfig m = model.planner_model();
  const planner::ParamCounts counts = count_parameters(model_dir, m, "vision");
  planner::DecodeShape s;
  s.frames = frames;
  s.text_tokens = text_tokens;
  s.tokens_per_frame = model.tokens_per_media();
  s.elem_bytes = dtype_bytes(request.dtype, "--dtype");
  s.weight_bytes = planner::decode_weight_bytes(m, counts.layers, counts.vocab, s.elem_bytes);
  std::vector<planner::DecodePrice> prices{planner::price_decode(m, cluster, s, 1, true)};
  if (world > 1)
    for (bool lead : {true, false})
      prices.push_back(planner::price_decode(m, cluster, s, world, lead));
  return planner::format_decode(prices);
}

}  // namespace lvx::runtime
