// Helpers shared by the planner tests (tests/test_planner_cost.cpp, tests/test_planner_plan.cpp):
// paths of the shipped configs in the source tree.
#pragma once

#include <string>

#include "tests/build_paths.h"

namespace lvx::planner::testing {

// `rel` (configs/models/..., configs/clusters/...) under the source tree.
inline std::string source(const std::string& rel) { return lvx::testing::source_dir() + "/" + rel; }

}  // namespace lvx::planner::testing
