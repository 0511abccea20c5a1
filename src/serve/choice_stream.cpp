// A chat completion's chunk events, choice by choice; see choice_stream.h.
#include "src/serve/choice_stream.h"

#include <chrono>
#include <deque>
#include <utility>

namespace lvx::serve {

namespace {

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace

ChoiceStream::ChoiceStream(std::vector<std::shared_ptr<Job>> jobs, std::string model)
    : jobs_(std::move(jobs)), model_(std::move(model)), ended_(jobs_.size(), false) {}

bool ChoiceStream::event(httplib::DataSink& sink, const json& j) {
  const bool shaped = jobs_.front()->req.completion && j.contains("object");  // not an error
  const std::string s = "data: " + dump(shaped ? as_text_completion(j) : j) + "\n\n";
  return sink.write(s.data(), s.size());
}

bool ChoiceStream::gone() {
  for (const auto& j : jobs_) j->cancelled = true;
  return false;
}

bool ChoiceStream::next(httplib::DataSink& sink) {
  const Job& first = *jobs_.front();
  if (!role_sent_) {
    role_sent_ = true;  // a completion has no role: its text comes first
    for (size_t i = 0; i < jobs_.size() && !first.req.completion; ++i)
      if (!event(sink, chunk_json(first.id, first.created, model_,
                                  {{"role", "assistant"}, {"content", ""}}, nullptr, nullptr,
                                  static_cast<int64_t>(i))))
        return gone();
  }
  // Wait on the first choice still running; with several, briefly, so none waits on another.
  size_t w = 0;
  while (ended_[w]) ++w;
  {
    Job& j = *jobs_[w];
    std::unique_lock<std::mutex> lock(j.mu);
    j.cv.wait_for(lock, std::chrono::milliseconds(jobs_.size() > 1 ? 50 : 500),
                  [&] { return !j.pieces.empty() || j.done; });
  }
  for (size_t i = 0; i < jobs_.size() && !failed_; ++i)
    if (!ended_[i] && !drain(i, sink)) return gone();
  if (!sink.is_writable()) return gone();
  for (size_t i = 0; i < jobs_.size() && !failed_; ++i)
    if (!ended_[i]) return true;
  end(sink);
  return true;
}

bool ChoiceStream::drain(size_t i, httplib::DataSink& sink) {
  Job& job = *jobs_[i];
  const Job& first = *jobs_.front();
  const auto index = static_cast<int64_t>(i);
  std::unique_lock<std::mutex> lock(job.mu);
  std::deque<std::string> pieces;
  pieces.swap(job.pieces);
  json entries = json::array();
  for (json& e : job.logprob_entries) entries.push_back(std::move(e));
  job.logprob_entries.clear();
  const bool done = job.done;
  lock.unlock();
  // The tokens' log-probabilities ride on the last piece of text sent with them (or on an
  // empty one: a token whose text waits for the rest of its character, or for a stop string).
  while (!pieces.empty() && pieces.back().empty()) pieces.pop_back();
  if (pieces.empty() && !entries.empty()) pieces.push_back("");
  for (size_t p = 0; p < pieces.size(); ++p) {
    const bool last = p + 1 == pieces.size();
    const json lp = last && !entries.empty() ? entries : json();
    if ((!pieces[p].empty() || !lp.is_null()) &&
        !event(sink, chunk_json(first.id, first.created, model_, {{"content", pieces[p]}}, nullptr,
                                lp, index)))
      return false;
  }
  if (!done) return true;
  ended_[i] = true;
  if (job.error) {
    failed_ = true;
    return event(sink, job.error->body());
  }
  return event(sink, chunk_json(first.id, first.created, model_, json::object(), job.finish_reason,
                                nullptr, index));
}

void ChoiceStream::end(httplib::DataSink& sink) {
  const Job& first = *jobs_.front();
  if (!failed_ && first.req.include_usage) {
    int64_t completion = 0;
    for (const auto& j : jobs_) completion += j->row["completion_tokens"].get<int64_t>();
    json u = chunk_json(first.id, first.created, model_, json::object(), nullptr);
    u["choices"] = json::array();
    u["usage"] = usage_json(first.row["prompt_tokens"].get<int64_t>(), completion);
    event(sink, u);
  }
  const std::string done = "data: [DONE]\n\n";
  sink.write(done.data(), done.size());
  sink.done();
}

}  // namespace lvx::serve
