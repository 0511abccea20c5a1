// One chat completion (POST /v1/chat/completions, or a completion: POST /v1/completions, the same
// way with its own parser and response shape): read and checked on its HTTP thread, queued for
// the scheduler or joined to an identical running generation, then answered whole or streamed as
// chat.completion.chunk events. A client that leaves cancels it (connection.h).
#include <chrono>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include "src/common/error.h"
#include "src/runtime/question_plan.h"
#include "src/serve/choice_stream.h"
#include "src/serve/connection.h"
#include "src/serve/kv_budget.h"
#include "src/serve/server_impl.h"

namespace lvx::serve {

namespace {

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

}  // namespace

void Server::chat(const httplib::Request& req, httplib::Response& res) {
  const Choices jobs = accept(req, res);
  if (jobs.empty()) return;
  // Wait for the first text (or the end), so that an error before it gets its own status; a
  // non-streaming answer waits for its end. Meanwhile the client may leave (cpp-httplib says
  // nothing until a write fails): its socket is looked at every 100 ms, and a client gone
  // cancels the request's jobs (not run if still queued; stopped at the next token if running).
  const int fd = connection_fd();
  auto wait_for = [&jobs, fd](Job& job, const std::function<bool()>& ready) {
    std::unique_lock<std::mutex> lock(job.mu);
    while (!job.cv.wait_for(lock, std::chrono::milliseconds(100), ready)) {
      if (client_gone(fd)) {
        for (const auto& j : jobs) j->cancelled = true;
        return false;
      }
    }
    return true;
  };
  const std::shared_ptr<Job>& job = jobs.front();
  if (!wait_for(*job, [&] { return job->first; })) return;
  {
    std::unique_lock<std::mutex> lock(job->mu);
    if (sent_job_error(*job, lock, res)) return;
  }
  if (job->req.stream) {
    respond_stream(jobs, res);
    return;
  }
  for (const auto& j : jobs)
    if (!wait_for(*j, [&] { return j->done; })) return;
  respond_whole(jobs, res);
}

bool Server::sent_job_error(Job& job, std::unique_lock<std::mutex>& lock, httplib::Response& res) {
  if (!job.error) return false;
  const ApiError e = *job.error;
  lock.unlock();
  send_error(res, e);
  return true;
}

Server::Choices Server::accept(const httplib::Request& req, httplib::Response& res) {
  // The gate admitted it with one of the keys (or none are configured): judge() in server.cpp.
  const std::string scope = key_scope(req).value_or("");
  if (failed_) {
    send_error(res, ApiError(503, "server_error", "a rank failed: " + client_error_text(failure_)));
    return {};
  }
  if (stopping()) {  // from the signal on, not from when the generation loop next looks
    send_error(res, ApiError(503, "server_error", "the server is shutting down"));
    return {};
  }
  auto job = std::make_shared<Job>();
  job->body = take_body_reservation();
  job->received = clock::now();
  job->created = unix_now();
  const bool completion = req.path == "/v1/completions";
  job->id = (completion ? "cmpl-lvx-" : "chatcmpl-lvx-") + std::to_string(next_id_++);
  job->scope = scope;
  try {
    // The body's text moves into the parser, which gives it back once parsed: its handler
    // thread holds the request until the answer is sent, and a 50 MB upload is 67 MB of base64
    // text. cpp-httplib owns the Request as a non-const object and hands it on as const&, so
    // moving from it is defined; nothing reads the body after this.
    std::string& body = const_cast<std::string&>(req.body);
    job->req = completion ? parse_completion_request(std::move(body), api_)
                          : parse_chat_request(std::move(body), api_);
    check_conversation(job->req);
    resolve_uuid(*job);
    spill_uploads(job->req, job->uploads);  // a queued request holds files, not bytes
    job->key = generation_key(describe(*job, nullptr));
    if (o_.max_kv_bytes > 0) job->kv_cost = kv_cost_of(*job);
  } catch (const ApiError& e) {
    send_error(res, e);
    return {};
  } catch (const Error& e) {  // the upload could not be written
    send_error(res, ApiError(500, "server_error", client_error_text(e.what())));
    return {};
  }
  Choices jobs = choices_of(job);
  if (jobs.size() > 1 || !join_running(job)) {
    std::lock_guard<std::mutex> lock(qmu_);
    const int64_t n = static_cast<int64_t>(jobs.size());
    if (static_cast<int64_t>(queue_.size()) + joined_ + n > o_.max_queue) {
      send_error(res,
                 ApiError(429, "rate_limit_error",
                          "the queue is full (" + std::to_string(o_.max_queue) +
                              " requests waiting, --max-queue" +
                              (n > 1 ? ", and n counts each choice" : "") + "): try again later",
                          "", "queue_full"));
      return {};
    }
    for (const auto& j : jobs) queue_.push_back(j);
  }
  qcv_.notify_all();
  return jobs;
}

// The jobs of a request's choices: itself, and for n > 1 a copy per further choice, with the
// next seed (or a fresh one), queued behind the first (Job::after).
Server::Choices Server::choices_of(const std::shared_ptr<Job>& first) {
  Choices jobs{first};
  for (int64_t i = 1; i < first->req.n; ++i) {
    auto j = std::make_shared<Job>();
    j->req = first->req;  // uploads are files by now: the copy holds their paths
    if (j->req.temperature > 0)
      j->req.seed = first->req.seeded ? first->req.seed + static_cast<uint64_t>(i) : fresh_seed();
    j->scope = first->scope;
    j->id = first->id + "." + std::to_string(i);  // the session's name for the row
    j->created = first->created;
    j->received = first->received;
    j->after = first;
    j->key = generation_key(describe(*j, nullptr));
    j->kv_cost = first->kv_cost;
    jobs.push_back(std::move(j));
  }
  return jobs;
}

void Server::respond_whole(const Choices& jobs, httplib::Response& res) {
  for (const auto& j : jobs) {
    std::unique_lock<std::mutex> lock(j->mu);
    if (sent_job_error(*j, lock, res)) return;
  }
  // Every job is done: nothing writes them any more.
  const Job& job = *jobs.front();
  const json& row = job.row;
  int64_t completion = 0;
  for (const auto& j : jobs) completion += j->row["completion_tokens"].get<int64_t>();
  json out = completion_json(job.id, job.created, o_.model_name, job.content, job.finish_reason,
                             row["prompt_tokens"].get<int64_t>(), completion,
                             job.req.logprobs ? row.value("logprobs", json::array()) : json());
  out["lvx"] = {{"frames", row["frames"]},
                {"timings", row["timings"]},
                {"visual_cache", row.value("visual_cache", json())}};
  if (row.contains("prompt_ids")) out["lvx"]["prompt_ids"] = row["prompt_ids"];
  for (size_t i = 1; i < jobs.size(); ++i) {  // n > 1: the further choices, and their rows' cache
    const Job& j = *jobs[i];
    json c = completion_json(j.id, j.created, o_.model_name, j.content, j.finish_reason, 0, 0,
                             j.req.logprobs ? j.row.value("logprobs", json::array()) : json());
    c["choices"][0]["index"] = i;
    out["choices"].push_back(c["choices"][0]);
    out["lvx"]["choices"].push_back({{"index", i},
                                     {"timings", j.row["timings"]},
                                     {"visual_cache", j.row.value("visual_cache", json())}});
  }
  if (job.req.completion) out = as_text_completion(std::move(out));
  res.set_content(dump(out), "application/json");
  metrics_.count(200);
}

void Server::respond_stream(const Choices& jobs, httplib::Response& res) {
  metrics_.count(200);
  ++handlers_;
  res.set_header("Cache-Control", "no-cache");
  // Called by cpp-httplib until it returns false or the sink is done: the role first (for each
  // choice), then the pieces as they come (waiting up to 500 ms for more), then each choice's
  // end, the usage and [DONE].
  auto provide = [stream = ChoiceStream(jobs, o_.model_name)](
                     size_t, httplib::DataSink& sink) mutable { return stream.next(sink); };
  res.set_chunked_content_provider("text/event-stream", provide, [this](bool) { --handlers_; });
}

void Server::resolve_uuid(Job& job) const {
  ChatRequest& r = job.req;
  if (r.video_uuid.empty() || r.video) return;
  const std::optional<std::string> hash = uuids_.find(job.scope, r.video_uuid);
  if (!hash)
    throw ApiError(
        400, "invalid_request_error",
        "uuid '" + r.video_uuid.substr(0, 64) +
            "' names no video sent with this API key: send the video with its uuid first",
        "messages", "uuid_not_found");
  r.video_hash = *hash;
}

int64_t Server::kv_cost_of(const Job& job) const {
  const ChatRequest& r = job.req;
  const runtime::QaJob& qa = session_.job();
  const bool own = r.fps || r.num_frames;  // the request's sampling, else the server's
  const int64_t frames =
      r.text_only() ? 0
      : !r.frames.empty()
          ? static_cast<int64_t>(r.frames.size())
          : runtime::planned_frames(own ? r.num_frames : qa.num_frames, own ? r.fps : qa.fps,
                                    r.start, r.end, r.video ? r.video->path : "", api_.max_frames,
                                    /*unknown=*/api_.max_frames);
  runtime::QaRequest q;
  q.item.question = r.question;
  q.earlier = r.earlier;
  q.item.system = r.system;
  if (r.completion) q.raw_prompt = r.prompt;
  if (r.completion && !r.text_only()) q.raw_after_media = r.prompt_after_media;
  const int64_t prompt = static_cast<int64_t>(session_.prompt(q, frames).ids.size());
  const int64_t tokens = r.max_tokens > 0 ? r.max_tokens : o_.default_max_tokens;
  const int64_t cost = question_kv_bytes(session_.model().planner_model(), frames, prompt, tokens,
                                         pg_.world_size(), dtype_bytes(qa.plan.dtype, "--dtype"));
  if (cost > o_.max_kv_bytes)
    throw ApiError(400, "invalid_request_error",
                   "the request needs " + format_bytes(cost) + " of KV cache per rank (" +
                       std::to_string(frames) + " frames, " + std::to_string(prompt) +
                       " prompt tokens, " + std::to_string(tokens) +
                       " new tokens), more than --max-kv-bytes " + format_bytes(o_.max_kv_bytes) +
                       ": ask for fewer frames or tokens",
                   "messages", "kv_budget_exceeded");
  return cost;
}

void Server::check_conversation(const ChatRequest& r) const {
  // The template's refusals (a system message it has no place for, a conversation it cannot
  // continue) before the request is queued; the frames' count does not change them.
  runtime::QaRequest q;
  q.item.question = r.question;
  q.earlier = r.earlier;
  q.item.system = r.system;
  if (r.completion) q.raw_prompt = r.prompt;
  if (r.completion && !r.text_only()) q.raw_after_media = r.prompt_after_media;
  try {
    (void)session_.prompt(q, 1);
  } catch (const Error& e) {
    std::string param = r.completion ? "prompt" : "messages";
    if (!r.system.empty()) {
      q.item.system.clear();
      try {
        (void)session_.prompt(q, 1);
        param = r.system_param;  // the system message alone is refused
      } catch (const Error&) {
      }
    }
    throw bad_request(std::string(e.what()) + " (" + param + ")", param);
  }
}

void Server::note_text(Job& j) {
  const clock::time_point now = clock::now();
  if (j.ttft_counted) {  // a later piece: the gap since the one before
    metrics_.observe(&Metrics::inter_token,
                     std::chrono::duration<double>(now - j.last_text).count());
    j.last_text = now;
    return;
  }
  j.ttft_counted = true;
  j.last_text = now;
  metrics_.observe(&Metrics::ttft, std::chrono::duration<double>(now - j.received).count());
}

bool Server::join_running(const std::shared_ptr<Job>& job) {
  if (!o_.merge_identical) return false;
  std::lock_guard<std::mutex> lock(gmu_);
  for (auto& r : batch_) {
    if (!r->open || job->key != r->key || !same_media(job->req, r->group.front()->req)) continue;
    {
      // A request waiting on a generation, queued or joined, is one of --max-queue: the HTTP
      // threads (max_queue + 8) stay enough for the others. Full: the queue's 429.
      std::lock_guard<std::mutex> qlock(qmu_);
      if (static_cast<int64_t>(queue_.size()) + joined_ >= o_.max_queue) return false;
      ++joined_;
    }
    ++r->joined;
    metrics_.observe(&Metrics::queue, seconds_since(job->received));
    if (!r->pieces.empty()) note_text(*job);  // its first text: every piece so far at once
    for (const std::string& piece : r->pieces) job->push_text(piece);
    for (const json& entry : r->logprob_entries) job->push_logprob(entry);
    r->group.push_back(job);
    ++running_;
    return true;
  }
  return false;
}

}  // namespace lvx::serve
