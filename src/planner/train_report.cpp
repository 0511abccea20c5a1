#include "src/planner/train_report.h"

namespace lvx::planner {

std::string train_report(const ModelConfig& m, const ParamCounts& counts, const Plan& plan,
                         int64_t frames, int64_t text_tokens, int64_t tokens_per_frame,
                         const TrainMemoryOptions& mo, const ClusterConfig& cluster,
                         nlohmann::json& j) {
  const TrainMemory tm = train_memory(m, counts, frames, text_tokens, tokens_per_frame, mo,
                                      static_cast<double>(cluster.device_memory_bytes));
  const TrainTraffic tt = train_traffic(m, counts, mo, cluster);
  j["train_memory"] = to_json(tm);
  j["train_traffic"] = to_json(tt);
  j["fits"] = plan.fits && tm.fits;
  return format_memory(tm) + format_traffic(tt, mo);
}

}  // namespace lvx::planner
