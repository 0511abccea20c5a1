// Samples prepared ahead of the training step (lvx finetune's data.prefetch, data.workers): while
// the step computes, worker threads decode the next samples' videos, sample and preprocess their
// frames and build their prompts, so that the device does not wait for FFmpeg at every sample.
//
// Only this rank's own work moves to the workers, exactly as the step did it: each rank decodes
// its own share of the frames, and the agreement on errors and every collective stay on the
// training thread, in order. A sample's result is the same bits with or without prefetch (the
// same decode, the same preprocessing), and an error is carried to the step that takes the
// sample, which reports it naming the row as before. Nothing of it is state: a resume starts a
// new prefetch at the resumed position.
//
// The samples a rank takes are first, first + stride, first + 2·stride, ... (its data-parallel
// group's share of the run's order). Each worker runs one intra-op thread, so that preprocessing
// does not take the step's cores from it (OpenMP's thread count is per thread).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "models/family.h"
#include "video/pipeline.h"

namespace lvx::runtime {

// One sample's work on this rank, before any collective: its frames (this rank's share), its
// prompt with the answer, or the error that stopped them.
struct LocalSample {
  video::FrameBatch frames;
  models::PromptTokens prompt;
  std::string error;   // "" when it worked
  double seconds = 0;  // the time its preparation took (on whichever thread)
};

class SamplePrefetch {
 public:
  // `make(k)` prepares sample k (never throws: errors go in LocalSample::error). `depth` samples
  // at most are held ready or in progress ahead of the one taken; 0 prepares each on the caller's
  // thread when taken (no workers).
  SamplePrefetch(std::function<LocalSample(int64_t)> make, int64_t first, int64_t stride, int depth,
                 int workers);
  ~SamplePrefetch();  // stops the workers (a sample in progress finishes first)
  SamplePrefetch(const SamplePrefetch&) = delete;
  SamplePrefetch& operator=(const SamplePrefetch&) = delete;

  // Sample k, waiting for it if it is not ready. Taken in order; a k out of that order (none in
  // lvx finetune) is prepared at once and the prefetch goes on after it.
  LocalSample take(int64_t k);

 private:
  void work();

  std::function<LocalSample(int64_t)> make_;
  int64_t next_;  // the next sample to give a worker
  int64_t stride_;
  int64_t taken_;  // the next sample take() expects
  int depth_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<int64_t, std::unique_ptr<LocalSample>> ready_;  // done (value) or in progress (null)
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace lvx::runtime
