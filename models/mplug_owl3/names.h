// mPLUG-Owl3's tensor names that its files share (model.cpp, decode.cpp): the language model's
// prefix and a decoder layer's.
#pragma once

#include <cstdint>
#include <string>

namespace lvx::models::mplug_owl3_names {

inline const std::string kLm = "language_model.model.";
inline std::string layer_prefix(int64_t i) { return kLm + "layers." + std::to_string(i) + "."; }

}  // namespace lvx::models::mplug_owl3_names
