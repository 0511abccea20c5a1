#include "src/runtime/question_plan.h"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <vector>

#include "src/common/error.h"
#include "src/planner/cluster_config.h"
#include "src/planner/decode_price.h"
#include "src/planner/question_price.h"
#include "src/runtime/device.h"
#include "src/runtime/model_description.h"
#include "video/decoder.h"

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

int64_t planned_frames(const std::optional<int64_t>& num_frames, const std::optional<double>& fps,
                       const std::optional<double>& start, const std::optional<double>& end,
                       const std::string& video_path, int64_t max_frames, int64_t unknown) {
  const int64_t most = max_frames > 0 ? max_frames : INT64_MAX;
  if (!fps) return std::min(num_frames.value_or(16), most);
  if (!end && video_path.empty()) return std::min(unknown, most);
  const double stop = end ? *end : video::VideoDecoder(video_path).info().duration_seconds;
  const double span = std::max(0.0, stop - start.value_or(0));
  return std::clamp<int64_t>(static_cast<int64_t>(std::floor(span * *fps)), 1, most);
}

int choose_ranks(const QaJob& job, int most) {
  LVX_CHECK(!job.plan.cluster.empty(),
            "--nproc auto prices the question on a cluster config: add --cluster C.yaml (lvx "
            "calibrate writes one for this machine)");
  const planner::ClusterConfig cluster = planner::load_cluster_config(job.plan.cluster);
  LVX_CHECK(planner::can_price_decode(cluster), "--nproc auto: the cluster config '",
            job.plan.cluster, "' has no memory: {bandwidth_gb_per_s} (lvx calibrate measures it)");
  const planner::ModelConfig m = planner_model(job.model);
  const planner::ParamCounts counts = count_parameters(job.model, m, "vision");
  planner::QuestionShape q;
  q.frames = planned_frames(job.num_frames, job.fps, job.start, job.end, job.video, job.max_frames,
                            /*unknown=*/16);
  q.text_tokens = q.frames + 64;
  q.tokens_per_frame = m.visual_tokens_per_frame;
  q.new_tokens = job.generation.max_new_tokens;
  const bool cpu = cluster.memory.shared;
  q.dtype = resolve_dtype(job.plan.dtype, cpu ? at::Device(at::kCPU) : at::Device(at::kCUDA, 0),
                          checkpoint_dtype(job.model));
  q.lm_parameters = counts.layers;
  q.weight_bytes =
      planner::decode_weight_bytes(m, counts.layers, counts.vocab, dtype_bytes(q.dtype, "--dtype"));
  const int64_t top = std::min<int64_t>(most, cluster.world_size());
  std::vector<planner::QuestionPrice> prices;
  for (int64_t n = 1; n <= top; ++n) prices.push_back(planner::price_question(m, cluster, q, n));
  const int64_t best = planner::fastest_ranks(prices);
  std::cerr << "lvx: --nproc auto: " << q.frames << " frames, ~" << q.text_tokens
            << " prompt tokens, " << q.new_tokens << " new tokens in " << q.dtype << " on "
            << cluster.name << ":\n"
            << planner::format_question(prices, q.new_tokens) << "lvx: --nproc auto: " << best
            << (best == 1 ? " rank" : " ranks") << "\n";
  return static_cast<int>(best);
}

}  // namespace lvx::runtime
