// One request of lvx serve, from the HTTP thread that received it to the main thread that runs it,
// and its answer back (text pieces as they come, stop strings cut on the way, then the end); and
// the key under which identical requests share one generation.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "src/serve/inflight_budget.h"
#include "src/serve/openai_api.h"
#include "src/serve/upload.h"

namespace lvx::serve {

using json = nlohmann::json;
using clock = std::chrono::steady_clock;

inline double seconds_since(clock::time_point t) {
  return std::chrono::duration<double>(clock::now() - t).count();
}

// One request from the HTTP thread that received it to the main thread that runs it, and its
// answer back: text pieces as they come, then the end (a row, or an error).
struct Job {
  ChatRequest req;
  std::string scope;  // the API key it came with ("key<i>"; "" without keys): where its uuid lives
  std::string key;    // generation_key of its description: what identical requests share
  InflightBudget::Reservation body;  // its body's bytes, held until the job is gone
  UploadDir uploads;                 // its inline media as files, removed with the job
  std::string id;
  int64_t created = 0;
  clock::time_point received;
  int64_t kv_cost = 0;  // KV bytes per rank its generation will hold (--max-kv-bytes)
  std::atomic<bool> cancelled{false};  // the client went away
  // A choice after the first of a request with n > 1: the first's job, which it waits behind in
  // the queue until that one's prompt prefix is prefilled (and in the visual cache, reused);
  // holding it keeps the request's uploaded files.
  std::shared_ptr<Job> after;
  std::atomic<bool> settled{false};  // `first`, readable without the lock

  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> pieces;    // text not yet sent (stop strings already cut)
  std::deque<json> logprob_entries;  // tokens' log-probabilities not yet sent (logprobs asked)
  bool first = false;                // the first text (or the end) arrived
  bool ttft_counted = false;         // its time to first text is in the metrics (main thread)
  clock::time_point last_text;       // when its latest text piece came (main thread)
  bool done = false;
  json row;                       // when done without error
  std::optional<ApiError> error;  // when done with one
  std::string content;            // the whole answer as sent
  std::string finish_reason;

  // Rank 0's stop-string filter over the generated text (runs on the main thread).
  std::string text;  // every piece so far
  size_t sent = 0;   // bytes of `text` handed to the client
  bool stop_hit = false;

  // A piece of the answer's text (main thread): what a stop string may not yet cut goes to the
  // client; a stop string found cuts the text there and ends what is sent.
  void push_text(const std::string& piece);
  // Ends with `r` and `final_text`, the whole answer (lvx qa's response, or the text cut at a
  // stop string): what the pieces sent so far lack of it follows them.
  void finish(json r, const std::string& finish, const std::string& final_text);
  // A new token's log-probabilities (main thread), for the stream's next chunk; none after a
  // stop string cut the text.
  void push_logprob(const json& entry);
  void fail(const ApiError& e);
};

// What a request's tokens depend on: its description as broadcast (src/serve/wire.h) without
// its id. Two requests with equal keys and the same media (same_media) get the same tokens.
std::string generation_key(const json& desc);
// Whether two requests send the same media: the same files, bytes and names, compared in place
// (no copy per queued or joining request).
bool same_media(const ChatRequest& a, const ChatRequest& b);

}  // namespace lvx::serve
