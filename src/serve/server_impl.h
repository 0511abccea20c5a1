// lvx serve's server, as its files share it (src/serve/server.h is the entry point):
//   server.cpp     the HTTP routes, the API key, binding, rank 0's life from listening to stopping
//   chat.cpp       one chat completion: read, queued or joined, its choices (n) answered whole
//                  or streamed (choice_stream.h: the chunk events)
//   scheduler.cpp  continuous batching on rank 0 (take, admit, step, retire) and the other ranks'
//                  loop that follows it; each answer's start from its broadcast description
//   job.h          a request and its answer between the HTTP thread and the main thread
//   metrics.h      the counters and /metrics
//   gate.h         the listening socket and every connection until its header is judged
//   connection.h   the client's socket (a client gone cancels its request)
//   wire.h         what rank 0 broadcasts to the others
#pragma once

#include <httplib.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "src/dist/process_group.h"
#include "src/runtime/qa_job.h"
#include "src/serve/gate.h"
#include "src/serve/inflight_budget.h"
#include "src/serve/job.h"
#include "src/serve/media_uuids.h"
#include "src/serve/metrics.h"
#include "src/serve/openai_api.h"
#include "src/serve/server.h"
#include "src/serve/wire.h"

namespace lvx::serve {

// Set by SIGTERM/SIGINT on rank 0: drain, then stop.
extern std::atomic<bool> g_stop_signal;

// The body bytes the gate reserved for the request this HTTP worker is handling (server.cpp),
// handed to its job; what no job took is released after the response.
InflightBudget::Reservation take_body_reservation();

// cpp-httplib's request processing (routes, bodies, responses) on a connection the gate admitted:
// process_request is protected, so this subclass opens it.
class HttpRoutes : public httplib::Server {
 public:
  // Returns whether the connection may carry another request.
  // cpp-httplib stops a chunked response when its listening socket is gone (it reads that as
  // shutting down): `listening` is the gate's socket while it runs, -1 after.
  void set_listening(int fd) { svr_sock_ = fd; }
  bool serve(httplib::Stream& s) {
    bool closed = false;
    return process_request(s, false, closed, nullptr) && !closed;
  }
};

class Server {
 public:
  // ranks_share_host: every rank runs on rank 0's machine (they read its upload files).
  Server(const ServeOptions& o, runtime::QaSession& session, bool ranks_share_host)
      : o_(o),
        session_(session),
        pg_(session.group()),
        budget_(o.max_inflight_bytes),
        ranks_share_host_(ranks_share_host) {
    api_.model_name = o.model_name;
    api_.allowed_media_path = o.allowed_media_path;
    api_.default_max_tokens = o.default_max_tokens;
    api_.max_frames = o.job.max_frames;
  }

  // Rank 0: listens on --host:--port (before any request: a port in use fails every rank at
  // once). Returns the error, or "".
  std::string bind();
  int run_rank0();
  int run_other_rank();

 private:
  struct Running;  // one generation of the batch (below)
  // The job's description as broadcast; its inline media's bytes copied into `blobs` (null: only
  // their places, for the generation key).
  json describe(const Job& job, std::vector<std::string>* blobs) const;
  // An answer begun on this rank, and the files of its media sent inline (kept until it has
  // advanced: its worker reads them).
  struct Begun {
    runtime::QaAnswerPtr answer;
    std::unique_ptr<UploadDir> uploads;
  };
  // Begins one answer command on this rank (QaSession::begin: its frames decoded on a worker of
  // this rank); media sent inline written to this rank's own files first.
  Begun begin_answer(const Command& c, const runtime::AnswerHooks& hooks);
  // Rank 0's scheduler (continuous batching), each turn: the next jobs while the batch has room
  // (waiting a little only when nothing runs), begun on every rank with the queued requests
  // identical to them; those whose frames are ready started (advance); one chunk of the oldest
  // prompt being prefilled in chunks; one token of every running generation; after each
  // command, the rows of those done, in batch order, and their clients' answers. The advance,
  // chunk and step return whether they sent a command.
  std::shared_ptr<Job> take_job();
  // The queue's first job may be taken (qmu_ held): there is one, and it waits for no other.
  bool front_ready() const;
  void admit(const std::shared_ptr<Job>& job);
  bool advance_prepared();
  // lvx_visual_cache_bytes from the session's sum (after each prefill, not only at the end).
  void note_cache_bytes();
  bool prefill_chunk();
  bool step_batch();
  // Only answers whose frames are being decoded: waits a little for them or a new request, and
  // keeps the other ranks' liveness (a heartbeat when due).
  void wait_for_work(clock::time_point& last_command, double heartbeat_s);
  void retire_done();
  // Whether `a` takes the next step: advanced, not prefilling, not done (the same on every rank).
  bool steps(const runtime::QaAnswer& a) const;
  // A running generation has no token yet: the loop steps again before the next chunk.
  bool awaits_first_token() const;
  void complete(Running& r, const json& row);
  void routes(httplib::Server& http);
  // The scope of the request's key ("key<i>"; "" without keys), or nothing when it has none:
  // what a uuid and a visual cache entry are known under.
  std::optional<std::string> key_scope(const httplib::Request& req) const;
  ApiError unauthorized(const httplib::Request& req) const;
  // The gate's judgement of a request from its header (gate.h), on the gate's thread: /health and
  // /metrics answered, then the key, the framing and the body's reservation, in that order (a
  // request without the key reserves nothing).
  Verdict judge(const httplib::Request& head);
  Verdict verdict_of(const ApiError& e);
  // A worker's request, admitted by the gate with its reservation.
  bool handle(ConnectionStream& s, InflightBudget::Reservation reserved);
  void resolve_uuid(Job& job) const;
  void send_error(httplib::Response& res, const ApiError& e);
  // The job's error sent, if it has one (`lock` holds job.mu and is released before the send):
  // true when it was.
  bool sent_job_error(Job& job, std::unique_lock<std::mutex>& lock, httplib::Response& res);
  // Reserves the request's declared body bytes, or the error that refuses it: 429 when the budget
  // is full now, 413 when it could never fit.
  std::variant<InflightBudget::Reservation, ApiError> reserve_body(const httplib::Request& req);
  // POST /v1/chat/completions (chat.cpp): the request read and queued (or joined to an identical
  // running generation), then its answer whole or as a stream of chunks.
  void chat(const httplib::Request& req, httplib::Response& res);
  // A request's jobs: one per choice (n), the first first. Empty when refused (answered).
  using Choices = std::vector<std::shared_ptr<Job>>;
  Choices accept(const httplib::Request& req, httplib::Response& res);
  Choices choices_of(const std::shared_ptr<Job>& first);
  void respond_whole(const Choices& jobs, httplib::Response& res);  // every job done
  void respond_stream(const Choices& jobs, httplib::Response& res);
  // Throws a 400 when the family's template refuses the request's conversation.
  void check_conversation(const ChatRequest& r) const;
  // --max-kv-bytes: the request's KV bytes per rank (src/serve/kv_budget.h); 400 naming its cost
  // and the limit when it exceeds the budget.
  int64_t kv_cost_of(const Job& job) const;
  void print_kv_budget() const;  // at start, with the planner's figure for one question
  // Joins `job` to the running generation when it is identical to it and still open: the text
  // so far is handed to it at once. Returns whether it joined.
  bool join_running(const std::shared_ptr<Job>& job);
  // A text piece of `j` arrived: its time to first text the first time, else the gap since
  // the piece before (the metrics' histograms).
  void note_text(Job& j);
  std::string metrics_text();
  // The main loop of rank 0 (scheduler.cpp): admit, step, retire until drained; throws what a
  // rank's failure throws. fail_everything answers every request in flight 503 after one.
  void serve_loop();
  void fail_everything(const std::exception& e);
  // Every queued job ends with `e` (a failed rank, or shutting down).
  void fail_queued(const ApiError& e);

  const ServeOptions& o_;
  runtime::QaSession& session_;
  dist::ProcessGroup& pg_;
  ApiOptions api_;
  Metrics metrics_;
  MediaUuids uuids_;
  InflightBudget budget_;
  bool ranks_share_host_;
  std::mutex qmu_;
  std::condition_variable qcv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::atomic<int64_t> running_{0};  // requests the running generations answer
  // One generation of the batch (rank 0): the requests it answers (the first, the queued ones
  // identical to it, those that joined it while it ran), what their tokens depend on, the text
  // so far; open while identical requests arriving may still join it (until it ends or every
  // client of it has stopped it: a joiner would get a cut answer). gmu_ guards group, pieces,
  // open and the batch's list; only the main thread adds or removes entries.
  struct Running {
    std::vector<std::shared_ptr<Job>> group;
    std::string key;
    int64_t kv_cost = 0;  // its KV bytes per rank (--max-kv-bytes), counted in kv_in_use_
    Command command;      // its description and inline media (compared in place by joiners)
    std::vector<std::string> pieces;
    std::vector<json> logprob_entries;  // each token's so far, when logprobs are asked
    bool open = false;
    int64_t joined = 0;
    runtime::QaAnswerPtr answer;
    std::unique_ptr<UploadDir> uploads;  // rank 0's files of media sent inline, until advanced
  };
  std::mutex gmu_;
  std::vector<std::unique_ptr<Running>> batch_;
  int64_t joined_ =
      0;  // requests that joined a running generation (they count against --max-queue)
  int64_t kv_in_use_ = 0;             // the running generations' KV bytes per rank (under qmu_)
  std::atomic<int64_t> handlers_{0};  // chat handlers still writing a response
  std::atomic<bool> draining_{false}, failed_{false};
  // Draining begins at the signal; draining_ is when the generation loop took note of it.
  bool stopping() const { return draining_ || g_stop_signal; }
  std::string failure_;
  std::atomic<int64_t> next_id_{0};
  std::shared_ptr<Job> admitting_;  // the job being admitted (main thread), failed with the rest
  HttpRoutes http_;
  std::unique_ptr<Gate> gate_;
  int port_ = 0;
};

}  // namespace lvx::serve
