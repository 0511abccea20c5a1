#include "tests/build_paths.h"

namespace lvx::testing {

std::string source_dir() { return LVX_SOURCE_DIR; }
std::string binary_dir() { return LVX_BINARY_DIR; }
std::string configured_python() { return LVX_PYTHON; }

}  // namespace lvx::testing
