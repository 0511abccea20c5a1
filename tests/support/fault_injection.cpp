// The fault hooks of lvx-faults (src/runtime/train_faults.h): lvx with these installed before
// main, driven by the environment of the test that runs it. Never linked into lvx.
//   LVX_FAULT_KILL=RANK@STEP        that rank SIGKILLs itself as optimizer step STEP begins (the
//                                   same as `kill -9` from outside at that moment)
//   LVX_FAULT_CHECKPOINT=POINT[@STEP]
//                                   the checkpoint writer _exit(137)s at POINT (after_first_file,
//                                   before_latest) of the checkpoint of step STEP (any when
//                                   omitted); slow waits LVX_FAULT_SLOW_S seconds (default 5)
//                                   there instead (a slow disk)
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "src/runtime/train_faults.h"

namespace {

class EnvFaults : public lvx::runtime::TrainFaults {
 public:
  void step_begins(int rank, int64_t step) override {
    const char* env = std::getenv("LVX_FAULT_KILL");
    if (!env) return;
    const std::string s = env;
    const size_t at = s.find('@');
    if (at == std::string::npos) return;
    if (std::atoi(s.substr(0, at).c_str()) != rank || std::atoll(s.c_str() + at + 1) != step)
      return;
    std::fprintf(stderr, "LVX_FAULT_KILL=%s: SIGKILL at step %lld\n", env,
                 static_cast<long long>(step));
    std::fflush(stderr);
    ::kill(::getpid(), SIGKILL);
  }

  void in_checkpoint(const char* point, int64_t step) override {
    const char* env = std::getenv("LVX_FAULT_CHECKPOINT");
    if (!env) return;
    std::string spec = env;
    const size_t at = spec.find('@');
    if (at != std::string::npos) {
      if (std::atoll(spec.c_str() + at + 1) != step) return;
      spec = spec.substr(0, at);
    }
    if (spec != point) return;
    if (spec == "slow") {  // the others must wait for the write however long it takes
      const char* secs = std::getenv("LVX_FAULT_SLOW_S");
      std::this_thread::sleep_for(std::chrono::duration<double>(secs ? std::atof(secs) : 5.0));
      return;
    }
    std::fprintf(stderr, "LVX_FAULT_CHECKPOINT=%s: exiting during the checkpoint of step %lld\n",
                 env, static_cast<long long>(step));
    std::fflush(stderr);
    ::_exit(137);
  }
};

const bool kInstalled = [] {
  lvx::runtime::install_train_faults(std::make_unique<EnvFaults>());
  return true;
}();

}  // namespace
