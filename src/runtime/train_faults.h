// A test seam of lvx finetune: the moments where a real fault hurts most, a rank killed as an
// optimizer step begins and the checkpoint writer dying mid-write or stalled on a slow disk.
// Tests install a hook object that acts there (tests/support/fault_injection.cpp, linked into
// the lvx-faults binary the kill-and-resume and interrupted-checkpoint tests run); lvx itself
// installs none, so each point is one pointer check and no environment is read.
#pragma once

#include <cstdint>
#include <memory>

namespace lvx::runtime {

class TrainFaults {
 public:
  virtual ~TrainFaults() = default;
  // Rank `rank` is about to run optimizer step `step` (1-based).
  virtual void step_begins(int rank, int64_t step) = 0;
  // The checkpoint of step `step` is at `point`: "slow" (before its first file),
  // "after_first_file", "before_latest" (renamed into place, `latest` not yet updated).
  virtual void in_checkpoint(const char* point, int64_t step) = 0;
};

// Installs the hooks (a test, before the job starts); replaces any installed before.
void install_train_faults(std::unique_ptr<TrainFaults> faults);
// The installed hooks, or nullptr (every production run).
TrainFaults* train_faults();

}  // namespace lvx::runtime
