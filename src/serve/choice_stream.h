// The streamed answer of one chat completion (stream: true) as chat.completion.chunk events: each
// choice's role, then its text pieces as they come (and their tokens' log-probabilities), then
// its end; with n > 1 the choices' events interleave, each marked by its index, as OpenAI's and
// vLLM's streams do. After every choice ended: the usage (stream_options.include_usage; the
// completion tokens of all choices) and [DONE]. A job's error ends the stream with its error
// object. A client gone cancels every choice.
#pragma once

#include <httplib.h>

#include <memory>
#include <string>
#include <vector>

#include "src/serve/job.h"

namespace lvx::serve {

class ChoiceStream {
 public:
  ChoiceStream(std::vector<std::shared_ptr<Job>> jobs, std::string model);
  // cpp-httplib's content provider: writes what has come since the last call (waiting up to
  // 500 ms for it); false when the client is gone.
  bool next(httplib::DataSink& sink);

 private:
  // Takes what choice `i` has for the client and writes it; false when the client is gone.
  bool drain(size_t i, httplib::DataSink& sink);
  bool event(httplib::DataSink& sink, const nlohmann::json& j);
  bool gone();
  void end(httplib::DataSink& sink);

  std::vector<std::shared_ptr<Job>> jobs_;
  std::string model_;
  std::vector<bool> ended_;
  bool role_sent_ = false;
  bool failed_ = false;  // an error event was sent: the stream ends
};

}  // namespace lvx::serve
