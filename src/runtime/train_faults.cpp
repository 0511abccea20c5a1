#include "src/runtime/train_faults.h"

namespace lvx::runtime {
namespace {

std::unique_ptr<TrainFaults>& installed() {
  static std::unique_ptr<TrainFaults> faults;  // set before the job's threads start
  return faults;
}

}  // namespace

void install_train_faults(std::unique_ptr<TrainFaults> faults) { installed() = std::move(faults); }

TrainFaults* train_faults() { return installed().get(); }

}  // namespace lvx::runtime
