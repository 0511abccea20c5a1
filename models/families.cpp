// The registry of model families (models/family.h): one line per family folder under models/.
#include "models/checkpoint.h"
#include "models/family.h"
#include "models/mllama/model.h"
#include "models/mplug_owl3.h"
#include "models/openflamingo.h"
#include "src/common/error.h"

namespace lvx::models {

const std::vector<const Family*>& families() {
  static const std::vector<const Family*> all = {
      &mplug_owl3::family(),
      &openflamingo::family(),
      &mllama::family(),
  };
  return all;
}

std::string supported_model_types() {
  std::string s;
  for (const Family* f : families()) s += (s.empty() ? "" : ", ") + f->model_type();
  return s;
}

const Family& family_of(const std::string& model_type, const std::string& where) {
  for (const Family* f : families())
    if (f->model_type() == model_type) return *f;
  LVX_FAIL(where, ": model_type '", model_type,
           "' is not supported (supported: ", supported_model_types(), ")");
}

const Family& family_of_config(const nlohmann::json& config, const std::string& where) {
  return family_of(config_string_or(config, "model_type", where, ""), where);
}

}  // namespace lvx::models
