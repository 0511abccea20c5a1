// Llama-3.2-Vision's released files, for lvx init-model (models/release_init.h, models/family.h).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "models/family.h"

namespace lvx::models::mllama {

ReleaseLayout release_layout(const nlohmann::json& config, const std::string& where);
nlohmann::json resize_release(const nlohmann::json& config, const ReleaseResize& r,
                              const std::string& where);

}  // namespace lvx::models::mllama
