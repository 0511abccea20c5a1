// Where this build's tree, the sources and the configured Python are, for tests that run lvx, a
// config or a reference script.
//
// Functions, not compile definitions in every test file: a definition naming the build folder made
// each test object differ between the CPU build and the CUDA build beside it (build-cuda), so
// ccache never shared them and CI's CUDA step recompiled every test file (32 objects, ~360 s of
// compile on 2 cores). Only build_paths.cpp, one small file per test binary, carries the paths.
#pragma once

#include <string>

namespace lvx::testing {

std::string source_dir();         // the checkout (CMake's PROJECT_SOURCE_DIR)
std::string binary_dir();         // this build folder (lvx, lvx-faults, tests/)
std::string configured_python();  // LVX_PYTHON as configured: the reference packages' Python

}  // namespace lvx::testing
