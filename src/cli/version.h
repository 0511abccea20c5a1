// `lvx --version`: the version and commit, the libtorch and CUDA it was built with, and the devices
// this process finds (CPU cores and native bf16, CUDA GPUs).
#pragma once

#include <string>

namespace lvx::cli {

std::string version_text();

}  // namespace lvx::cli
