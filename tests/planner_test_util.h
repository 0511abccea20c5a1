// Helpers shared by the planner tests (tests/test_planner_cost.cpp, tests/test_planner_plan.cpp):
// paths of the shipped configs in the source tree.
#pragma once

#include <string>

namespace lvx::planner::testing {

// `rel` (configs/models/..., configs/clusters/...) under the source tree.
inline std::string source(const std::string& rel) {
  return std::string(LVX_SOURCE_DIR) + "/" + rel;
}

}  // namespace lvx::planner::testing
