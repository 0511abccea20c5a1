// Over 600 lines (about 1,050): its split along HTTP, request parsing, the scheduler, the job and
// metrics is still open in issue 31; continuous batching (the scheduler: take_job, admit,
// step_batch, retire_done) landed first, so the split now has its final pieces to move.
#include "src/serve/server.h"

#include <dirent.h>
#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "src/common/error.h"
#include "src/dist/process_group.h"
#include "src/serve/http_framing.h"
#include "src/serve/openai_api.h"
#include "src/serve/wire.h"

namespace lvx::serve {

namespace fs = std::filesystem;
using nlohmann::json;
using clock = std::chrono::steady_clock;

namespace {

std::atomic<bool> g_stop_signal{false};
extern "C" void on_stop_signal(int) { g_stop_signal = true; }

double seconds_since(clock::time_point t) {
  return std::chrono::duration<double>(clock::now() - t).count();
}

int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// One end of socket `fd` (peer: the other end) as numeric host and port.
bool socket_end(int fd, bool peer, std::string& host, int& port) {
  sockaddr_storage a{};
  socklen_t n = sizeof(a);
  auto* sa = reinterpret_cast<sockaddr*>(&a);
  if ((peer ? ::getpeername(fd, sa, &n) : ::getsockname(fd, sa, &n)) != 0) return false;
  char h[NI_MAXHOST], p[NI_MAXSERV];
  if (::getnameinfo(sa, n, h, sizeof(h), p, sizeof(p), NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return false;
  host = h;
  port = std::atoi(p);
  return true;
}

// The first of this process's sockets that `match` takes, or -1.
int find_socket(const std::function<bool(int)>& match) {
  DIR* d = ::opendir("/proc/self/fd");
  if (!d) return -1;
  int found = -1;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
    const int fd = std::atoi(e->d_name);
    struct stat st {};
    if (fd == ::dirfd(d) || ::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    if (match(fd)) {
      found = fd;
      break;
    }
  }
  ::closedir(d);
  return found;
}

// The socket of `req`'s connection: cpp-httplib 0.11 hands a handler no socket, so it is found
// among this process's descriptors by its two ends (local and remote address and port, unique
// while the connection is open). -1 when none matches.
int connection_fd(const httplib::Request& req) {
  return find_socket([&](int fd) {
    std::string lh, rh;
    int lp = -1, rp = -1;
    return socket_end(fd, false, lh, lp) && lp == req.local_port &&
           socket_end(fd, true, rh, rp) && rp == req.remote_port && rh == req.remote_addr;
  });
}

// cpp-httplib listens with a backlog of 5 (CPPHTTPLIB_LISTEN_BACKLOG, fixed when Debian built its
// shared library): clients that connect at once beyond it lose their SYN and retry a second
// later, TCP's first retransmission (bench_serve saw 1 s time-to-first-token stalls at 16
// clients). Listening again on the bound socket takes a new backlog (Linux), here the kernel's
// cap, net.core.somaxconn.
void widen_listen_backlog(int port) {
  const int fd = find_socket([&](int fd) {
    int listening = 0;
    socklen_t n = sizeof(listening);
    std::string host;
    int p = -1;
    return ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &n) == 0 && listening != 0 &&
           socket_end(fd, false, host, p) && p == port;
  });
  if (fd >= 0) ::listen(fd, SOMAXCONN);
}

// Whether the client at the other end of `fd` closed its side (an end of file waits to be read,
// or the socket failed). A client that sent more bytes (a pipelined request) is still there.
bool client_gone(int fd) {
  if (fd < 0) return false;
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  if (::poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLERR | POLLHUP | POLLNVAL | POLLRDHUP)) return true;
  char c = 0;
  const ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

// Whether a client's text equals a secret, in time that depends on the secret's length only (no
// early exit at the first differing byte, which would let a client find the key byte by byte).
bool same_secret(const std::string& given, const std::string& secret) {
  volatile unsigned char diff = given.size() == secret.size() ? 0 : 1;
  for (size_t i = 0; i < secret.size(); ++i)
    diff = diff | static_cast<unsigned char>(secret[i] ^ (i < given.size() ? given[i] : 0));
  return diff == 0;
}

// One request from the HTTP thread that received it to the main thread that runs it, and its
// answer back: text pieces as they come, then the end (a row, or an error).
struct Job {
  ChatRequest req;
  std::string id;
  int64_t created = 0;
  clock::time_point received;
  std::atomic<bool> cancelled{false};  // the client went away

  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> pieces;  // text not yet sent (stop strings already cut)
  bool first = false;              // the first text (or the end) arrived
  bool ttft_counted = false;       // its time to first text is in the metrics (main thread)
  bool done = false;
  json row;                       // when done without error
  std::optional<ApiError> error;  // when done with one
  std::string content;            // the whole answer as sent
  std::string finish_reason;

  // Rank 0's stop-string filter over the generated text (runs on the main thread).
  std::string text;  // every piece so far
  size_t sent = 0;   // bytes of `text` handed to the client
  bool stop_hit = false;

  void push_text(const std::string& piece) {
    if (stop_hit) return;
    text += piece;
    size_t safe = text.size();
    size_t longest = 0;
    for (const std::string& s : req.stop) {
      const size_t at = text.find(s, sent > s.size() ? sent - s.size() : 0);
      if (at != std::string::npos && at < safe) {
        safe = at;
        stop_hit = true;
      }
      longest = std::max(longest, s.size());
    }
    if (stop_hit) {
      text.resize(safe);
    } else if (longest > 1) {  // a stop string may begin in the last bytes: hold them back
      safe = text.size() >= longest - 1 ? text.size() - (longest - 1) : 0;
    }
    if (safe > sent) {
      std::lock_guard<std::mutex> lock(mu);
      pieces.push_back(text.substr(sent, safe - sent));
      sent = safe;
      first = true;
      cv.notify_all();
    }
  }
  // Ends with `r` and `final_text`, the whole answer (lvx qa's response, or the text cut at a
  // stop string): what the pieces sent so far lack of it follows them.
  void finish(json r, const std::string& finish, const std::string& final_text) {
    std::lock_guard<std::mutex> lock(mu);
    if (final_text.size() > sent && final_text.compare(0, sent, text, 0, sent) == 0)
      pieces.push_back(final_text.substr(sent));
    sent = final_text.size();
    content = final_text;
    row = std::move(r);
    finish_reason = finish;
    done = first = true;
    cv.notify_all();
  }
  void fail(const ApiError& e) {
    std::lock_guard<std::mutex> lock(mu);
    error = e;
    done = first = true;
    cv.notify_all();
  }
};

// What a request's tokens depend on: its description as broadcast (src/serve/wire.h) without
// its id. Two requests with equal keys and equal inline media get the same tokens.
std::string generation_key(const json& desc) {
  json d = desc;
  d.erase("id");
  return d.dump();
}

// Prometheus counters (rank 0).
struct Metrics {
  std::mutex mu;
  std::map<int, int64_t> requests;  // by HTTP status
  int64_t prompt_tokens = 0, completion_tokens = 0;
  double ttft_sum = 0, latency_sum = 0;
  int64_t ttft_count = 0, latency_count = 0;
  std::vector<double> ttft_buckets{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
  std::vector<int64_t> ttft_counts = std::vector<int64_t>(10, 0);
  int64_t cache_hits = 0, cache_misses = 0, cache_bytes = 0;  // over every rank
  int64_t prefix_reuses = 0;  // requests whose prompt prefix state was reused
  int64_t cancelled = 0;  // requests whose client went away before the answer ended
  int64_t merged = 0;     // requests answered by an identical request's generation
  // Continuous batching: decode steps, the generations they stepped, the most in one step.
  int64_t steps = 0, step_rows = 0, most_rows = 0;
  void count(int status) {
    std::lock_guard<std::mutex> lock(mu);
    ++requests[status];
  }
};

class Server {
 public:
  Server(const ServeOptions& o, runtime::QaSession& session)
      : o_(o), session_(session), pg_(session.group()) {
    api_.model_name = o.model_name;
    api_.allowed_media_path = o.allowed_media_path;
    api_.default_max_tokens = o.default_max_tokens;
  }

  // Rank 0: listens on --host:--port (before any request: a port in use fails every rank at
  // once). Returns the error, or "".
  std::string bind();
  int run_rank0();
  int run_other_rank();

 private:
  struct Running;  // one generation of the batch (below)
  json describe(const Job& job, std::vector<std::string>& blobs) const;
  // Starts one answer command on this rank (media sent inline written to this rank's own files
  // for the prefill): the frames and the prompt's prefill (QaSession::start).
  runtime::QaAnswerPtr start_answer(const Command& c, const runtime::AnswerHooks& hooks);
  // Rank 0's scheduler (continuous batching): the next job when the batch has room (waiting a
  // little only when nothing runs); starting its generation on every rank, with the queued
  // requests identical to it; one token of every running generation on every rank; the rows of
  // those done, in batch order, and their clients' answers.
  std::shared_ptr<Job> take_job();
  void admit(const std::shared_ptr<Job>& job);
  void step_batch();
  void retire_done();
  void complete(Running& r, const json& row);
  void routes(httplib::Server& http);
  bool authorized(const httplib::Request& req, httplib::Response& res);
  void send_error(httplib::Response& res, const ApiError& e);
  void chat(const httplib::Request& req, httplib::Response& res);
  // Throws a 400 when the family's template refuses the request's conversation.
  void check_conversation(const ChatRequest& r) const;
  // Joins `job` to the running generation when it is identical to it and still open: the text
  // so far is handed to it at once. Returns whether it joined.
  bool join_running(const std::shared_ptr<Job>& job);
  // Counts `j`'s time to first text once.
  void note_first(Job& j);
  std::string metrics_text();
  // Every queued job ends with `e` (a failed rank, or shutting down).
  void fail_queued(const ApiError& e);

  const ServeOptions& o_;
  runtime::QaSession& session_;
  dist::ProcessGroup& pg_;
  ApiOptions api_;
  Metrics metrics_;
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
    Command command;  // its description and inline media (compared in place by joiners)
    std::vector<std::string> pieces;
    bool open = false;
    int64_t joined = 0;
    runtime::QaAnswerPtr answer;
  };
  std::mutex gmu_;
  std::vector<std::unique_ptr<Running>> batch_;
  int64_t joined_ = 0;  // requests that joined a running generation (they count against --max-queue)
  std::atomic<int64_t> handlers_{0};  // chat handlers still writing a response
  std::atomic<bool> draining_{false}, failed_{false};
  // Draining begins at the signal; draining_ is when the generation loop took note of it.
  bool stopping() const { return draining_ || g_stop_signal; }
  std::string failure_;
  std::atomic<int64_t> next_id_{0};
  httplib::Server http_;
  int port_ = 0;
};

json Server::describe(const Job& job, std::vector<std::string>& blobs) const {
  const ChatRequest& r = job.req;
  auto ref = [&](const MediaRef& m) {
    if (!m.path.empty()) return json{{"path", m.path}};
    blobs.push_back(m.bytes);
    return json{{"blob", blobs.size() - 1}, {"ext", m.ext}};
  };
  auto opt = [](const auto& v) { return v ? json(*v) : json(); };
  json d{{"id", job.id},
         {"system", r.system},
         {"earlier", r.earlier},
         {"question", r.question},
         {"return_prompt_ids", r.return_prompt_ids},
         {"fps", opt(r.fps)},
         {"num_frames", opt(r.num_frames)},
         {"start", opt(r.start)},
         {"end", opt(r.end)},
         {"video_id", r.video_id},
         {"max_tokens", r.max_tokens},
         {"temperature", r.temperature},
         {"top_p", r.top_p},
         {"seed", r.seed}};
  if (r.video) d["video"] = ref(*r.video);
  json frames = json::array();
  for (const MediaRef& m : r.frames) frames.push_back(ref(m));
  d["frames"] = frames;
  return d;
}

runtime::QaAnswerPtr Server::start_answer(const Command& c, const runtime::AnswerHooks& hooks) {
  const json& d = c.desc;
  // A folder of its own, made by mkdtemp: unpredictable and private (0700), so no other local
  // user can plant a link in it or read the uploads.
  std::string tmpl = (fs::temp_directory_path() / "lvx-serve-XXXXXX").string();
  LVX_CHECK(::mkdtemp(tmpl.data()) != nullptr, "cannot make a temporary folder in ",
            fs::temp_directory_path().string());
  const fs::path dir = tmpl;
  struct Cleanup {
    fs::path dir;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
  } cleanup{dir};
  auto file_of = [&](const json& ref, const std::string& name) -> std::string {
    if (ref.contains("path")) return ref["path"].get<std::string>();
    const std::string path = (dir / (name + ref["ext"].get<std::string>())).string();
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    const std::string& b = c.blobs.at(ref["blob"].get<size_t>());
    f.write(b.data(), static_cast<std::streamsize>(b.size()));
    LVX_CHECK(f.good(), "cannot write '", path, "'");
    return path;
  };
  runtime::QaRequest q;
  q.item.id = d["id"].get<std::string>();
  q.item.question = d["question"].get<std::string>();
  q.item.system = d["system"].get<std::string>();
  q.earlier = d["earlier"].get<std::vector<std::pair<std::string, std::string>>>();
  q.return_prompt_ids = d["return_prompt_ids"].get<bool>();
  if (d.contains("video")) q.item.video = file_of(d["video"], "video");
  q.cache_frame_index = !(d.contains("video") && d["video"].contains("blob"));  // an upload
  for (size_t i = 0; i < d["frames"].size(); ++i)
    q.image_files.push_back(file_of(d["frames"][i], "frame" + std::to_string(i)));
  if (!d["fps"].is_null()) q.fps = d["fps"].get<double>();
  if (!d["num_frames"].is_null()) q.num_frames = d["num_frames"].get<int64_t>();
  if (!d["start"].is_null()) q.item.start = d["start"].get<double>();
  if (!d["end"].is_null()) q.item.end = d["end"].get<double>();
  q.video_id = d["video_id"].get<std::string>();
  runtime::GenerateOptions g = session_.job().generation;
  g.max_new_tokens = d["max_tokens"].get<int64_t>();
  g.sampling.temperature = d["temperature"].get<double>();
  g.sampling.top_p = d["top_p"].get<double>();
  g.sampling.seed = d["seed"].get<uint64_t>();
  q.generation = g;
  return session_.start(q, hooks);
}

int Server::run_other_rank() {
  ::signal(SIGTERM, SIG_IGN);  // rank 0 says when to stop
  ::signal(SIGINT, SIG_IGN);
  // The generations rank 0 runs, in its order: started, stepped and finished as it says.
  std::vector<runtime::QaAnswerPtr> active;
  runtime::AnswerHooks hooks;
  hooks.stop_requested = [] { return false; };  // set on every rank (rank 0's flag is the one)
  for (;;) {
    Command c;
    exchange(pg_, c);
    if (c.op == Op::kShutdown) {
      pg_.barrier();
      return 0;
    }
    if (c.op == Op::kAnswer) active.push_back(start_answer(c, hooks));
    if (c.op == Op::kStep) {
      std::vector<runtime::QaAnswer*> step;
      for (auto& a : active) step.push_back(a.get());
      session_.step(step);
    }
    for (auto it = active.begin(); it != active.end();) {
      if (!session_.done(**it)) {
        ++it;
        continue;
      }
      session_.finish(**it);
      it = active.erase(it);
    }
  }
}

bool Server::authorized(const httplib::Request& req, httplib::Response& res) {
  if (o_.api_key.empty()) return true;
  if (same_secret(req.get_header_value("Authorization"), "Bearer " + o_.api_key)) return true;
  send_error(res, ApiError(401, "invalid_request_error",
                           req.has_header("Authorization")
                               ? "Incorrect API key provided"
                               : "Missing API key: send 'Authorization: Bearer <key>'",
                           "", "invalid_api_key"));
  return false;
}

void Server::send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status;
  res.set_content(e.body_text(), "application/json");
  metrics_.count(e.status);
}

void Server::fail_queued(const ApiError& e) {
  std::deque<std::shared_ptr<Job>> q;
  {
    std::lock_guard<std::mutex> lock(qmu_);
    q.swap(queue_);
  }
  for (auto& j : q) j->fail(e);
}

void Server::check_conversation(const ChatRequest& r) const {
  // The template's refusals (a system message it has no place for, a conversation it cannot
  // continue) before the request is queued; the frames' count does not change them.
  runtime::QaRequest q;
  q.item.question = r.question;
  q.earlier = r.earlier;
  q.item.system = r.system;
  try {
    (void)session_.prompt(q, 1);
  } catch (const Error& e) {
    std::string param = "messages";
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

void Server::note_first(Job& j) {
  if (j.ttft_counted) return;
  j.ttft_counted = true;
  const double t = seconds_since(j.received);
  std::lock_guard<std::mutex> lock(metrics_.mu);
  metrics_.ttft_sum += t;
  ++metrics_.ttft_count;
  for (size_t i = 0; i < metrics_.ttft_buckets.size(); ++i)
    if (t <= metrics_.ttft_buckets[i]) {
      ++metrics_.ttft_counts[i];
      break;
    }
}

bool Server::join_running(const std::shared_ptr<Job>& job) {
  if (!o_.merge_identical) return false;
  std::vector<std::string> blobs;
  const std::string key = generation_key(describe(*job, blobs));
  std::lock_guard<std::mutex> lock(gmu_);
  for (auto& r : batch_) {
    if (!r->open || key != r->key || blobs != r->command.blobs) continue;
    {
      // A request waiting on a generation, queued or joined, is one of --max-queue: the HTTP
      // threads (max_queue + 8) stay enough for the others. Full: the queue's 429.
      std::lock_guard<std::mutex> qlock(qmu_);
      if (static_cast<int64_t>(queue_.size()) + joined_ >= o_.max_queue) return false;
      ++joined_;
    }
    ++r->joined;
    for (const std::string& piece : r->pieces) {
      note_first(*job);
      job->push_text(piece);
    }
    r->group.push_back(job);
    ++running_;
    return true;
  }
  return false;
}

void Server::chat(const httplib::Request& req, httplib::Response& res) {
  if (!authorized(req, res)) return;
  if (failed_) {
    send_error(res,
               ApiError(503, "server_error", "a rank failed: " + client_error_text(failure_)));
    return;
  }
  if (stopping()) {  // from the signal on, not from when the generation loop next looks
    send_error(res, ApiError(503, "server_error", "the server is shutting down"));
    return;
  }
  auto job = std::make_shared<Job>();
  job->received = clock::now();
  job->created = unix_now();
  job->id = "chatcmpl-lvx-" + std::to_string(next_id_++);
  try {
    job->req = parse_chat_request(req.body, api_);
    check_conversation(job->req);
  } catch (const ApiError& e) {
    send_error(res, e);
    return;
  }
  if (!join_running(job)) {
    std::lock_guard<std::mutex> lock(qmu_);
    if (static_cast<int64_t>(queue_.size()) + joined_ >= o_.max_queue) {
      send_error(res, ApiError(429, "rate_limit_error",
                               "the queue is full (" + std::to_string(o_.max_queue) +
                                   " requests waiting, --max-queue): try again later",
                               "", "queue_full"));
      return;
    }
    queue_.push_back(job);
  }
  qcv_.notify_all();
  // Wait for the first text (or the end), so that an error before it gets its own status; a
  // non-streaming answer waits for its end. Meanwhile the client may leave (cpp-httplib says
  // nothing until a write fails): its socket is looked at every 100 ms, and a client gone
  // cancels the job (not run if still queued; stopped at its next token if running).
  const int fd = connection_fd(req);
  auto wait_for = [&](const std::function<bool()>& ready) {
    std::unique_lock<std::mutex> lock(job->mu);
    while (!job->cv.wait_for(lock, std::chrono::milliseconds(100), ready)) {
      if (client_gone(fd)) {
        job->cancelled = true;
        return false;
      }
    }
    return true;
  };
  if (!wait_for([&] { return job->first; })) return;
  {
    std::unique_lock<std::mutex> lock(job->mu);
    if (job->error) {
      const ApiError e = *job->error;
      lock.unlock();
      send_error(res, e);
      return;
    }
  }
  const std::string model = o_.model_name;
  if (!job->req.stream) {
    if (!wait_for([&] { return job->done; })) return;
    std::unique_lock<std::mutex> lock(job->mu);
    if (job->error) {
      const ApiError e = *job->error;
      lock.unlock();
      send_error(res, e);
      return;
    }
    const std::string content = job->content;
    const json& row = job->row;
    json out = completion_json(job->id, job->created, model, content, job->finish_reason,
                               row["prompt_tokens"].get<int64_t>(),
                               row["completion_tokens"].get<int64_t>());
    out["lvx"] = {{"frames", row["frames"]},
                  {"timings", row["timings"]},
                  {"visual_cache", row.value("visual_cache", json())}};
    if (row.contains("prompt_ids")) out["lvx"]["prompt_ids"] = row["prompt_ids"];
    res.set_content(out.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
    metrics_.count(200);
    return;
  }
  metrics_.count(200);
  ++handlers_;
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, job, model, role_sent = false](size_t, httplib::DataSink& sink) mutable {
        auto event = [&](const json& j) {
          const std::string s =
              "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n";
          return sink.write(s.data(), s.size());
        };
        if (!role_sent) {
          role_sent = true;
          if (!event(chunk_json(job->id, job->created, model,
                                {{"role", "assistant"}, {"content", ""}}, nullptr))) {
            job->cancelled = true;
            return false;
          }
        }
        std::unique_lock<std::mutex> lock(job->mu);
        job->cv.wait_for(lock, std::chrono::milliseconds(500),
                         [&] { return !job->pieces.empty() || job->done; });
        std::deque<std::string> pieces;
        pieces.swap(job->pieces);
        const bool done = job->done;
        lock.unlock();
        for (const std::string& p : pieces)
          if (!p.empty() &&
              !event(chunk_json(job->id, job->created, model, {{"content", p}}, nullptr))) {
            job->cancelled = true;
            return false;
          }
        if (!sink.is_writable()) {
          job->cancelled = true;
          return false;
        }
        if (!done) return true;
        if (job->error) {
          event(job->error->body());
        } else {
          event(chunk_json(job->id, job->created, model, json::object(), job->finish_reason));
          if (job->req.include_usage) {
            json u = chunk_json(job->id, job->created, model, json::object(), nullptr);
            u["choices"] = json::array();
            u["usage"] = usage_json(job->row["prompt_tokens"].get<int64_t>(),
                                    job->row["completion_tokens"].get<int64_t>());
            event(u);
          }
        }
        const std::string end = "data: [DONE]\n\n";
        sink.write(end.data(), end.size());
        sink.done();
        return true;
      },
      [this](bool) { --handlers_; });
}

std::string Server::metrics_text() {
  std::ostringstream m;
  const runtime::VisualCacheStats own = session_.cache_stats();
  int64_t depth = 0;
  {
    std::lock_guard<std::mutex> lock(qmu_);
    depth = static_cast<int64_t>(queue_.size());
  }
  std::lock_guard<std::mutex> lock(metrics_.mu);
  m << "# HELP lvx_requests_total Chat completion requests answered, by HTTP status.\n"
    << "# TYPE lvx_requests_total counter\n";
  for (const auto& [status, n] : metrics_.requests)
    m << "lvx_requests_total{status=\"" << status << "\"} " << n << "\n";
  m << "# TYPE lvx_prompt_tokens_total counter\nlvx_prompt_tokens_total " << metrics_.prompt_tokens
    << "\n"
    << "# TYPE lvx_generated_tokens_total counter\nlvx_generated_tokens_total "
    << metrics_.completion_tokens << "\n"
    << "# HELP lvx_time_to_first_token_seconds From a request's arrival to its first text.\n"
    << "# TYPE lvx_time_to_first_token_seconds histogram\n";
  int64_t cum = 0;
  for (size_t i = 0; i < metrics_.ttft_buckets.size(); ++i) {
    cum += metrics_.ttft_counts[i];
    m << "lvx_time_to_first_token_seconds_bucket{le=\"" << metrics_.ttft_buckets[i] << "\"} " << cum
      << "\n";
  }
  m << "lvx_time_to_first_token_seconds_bucket{le=\"+Inf\"} " << metrics_.ttft_count << "\n"
    << "lvx_time_to_first_token_seconds_sum " << metrics_.ttft_sum << "\n"
    << "lvx_time_to_first_token_seconds_count " << metrics_.ttft_count << "\n"
    << "# TYPE lvx_request_seconds summary\nlvx_request_seconds_sum " << metrics_.latency_sum
    << "\nlvx_request_seconds_count " << metrics_.latency_count << "\n"
    << "# HELP lvx_visual_cache_hits_total Ranks that found their share of a request's frames "
       "encoded already (summed over ranks).\n"
    << "# TYPE lvx_visual_cache_hits_total counter\nlvx_visual_cache_hits_total "
    << metrics_.cache_hits << "\n"
    << "# TYPE lvx_visual_cache_misses_total counter\nlvx_visual_cache_misses_total "
    << metrics_.cache_misses << "\n"
    << "# HELP lvx_prefix_reuses_total Requests whose prompt prefix (up to its last image token) "
       "started from the state a previous request's prefill left (every rank's, kept with the "
       "video's visual features).\n"
    << "# TYPE lvx_prefix_reuses_total counter\nlvx_prefix_reuses_total " << metrics_.prefix_reuses
    << "\n"
    << "# HELP lvx_visual_cache_bytes Bytes held by the visual caches of every rank.\n"
    << "# TYPE lvx_visual_cache_bytes gauge\nlvx_visual_cache_bytes " << metrics_.cache_bytes
    << "\n"
    << "# TYPE lvx_visual_cache_entries gauge\nlvx_visual_cache_entries{rank=\"0\"} " << own.entries
    << "\n"
    << "# TYPE lvx_visual_cache_capacity_bytes gauge\nlvx_visual_cache_capacity_bytes{rank=\"0\"} "
    << own.capacity << "\n"
    << "# HELP lvx_requests_cancelled_total Requests whose client went away before the answer "
       "ended (their generation stopped, or never ran).\n"
    << "# TYPE lvx_requests_cancelled_total counter\nlvx_requests_cancelled_total "
    << metrics_.cancelled << "\n"
    << "# HELP lvx_requests_merged_total Requests answered by the generation of an identical "
       "request (queued with them, or running when they arrived).\n"
    << "# TYPE lvx_requests_merged_total counter\nlvx_requests_merged_total " << metrics_.merged
    << "\n"
    << "# HELP lvx_decode_steps_total Decode steps run (each gives every running generation its "
       "next token).\n"
    << "# TYPE lvx_decode_steps_total counter\nlvx_decode_steps_total " << metrics_.steps << "\n"
    << "# HELP lvx_decode_step_rows_total Generations stepped, summed over the decode steps (over "
       "lvx_decode_steps_total: the mean batch).\n"
    << "# TYPE lvx_decode_step_rows_total counter\nlvx_decode_step_rows_total "
    << metrics_.step_rows << "\n"
    << "# TYPE lvx_decode_batch_max gauge\nlvx_decode_batch_max " << metrics_.most_rows << "\n"
    << "# TYPE lvx_queue_depth gauge\nlvx_queue_depth " << depth << "\n"
    << "# TYPE lvx_requests_running gauge\nlvx_requests_running " << running_.load() << "\n"
    << "# TYPE lvx_ranks gauge\nlvx_ranks " << pg_.world_size() << "\n";
  return m.str();
}

void Server::routes(httplib::Server& http) {
  // Framing is judged from the headers, before the body is read (http_framing.h).
  http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    const auto bad = framing_error(req, o_.max_body_bytes);
    if (!bad) return httplib::Server::HandlerResponse::Unhandled;
    send_error(res, *bad);
    res.set_header("Connection", "close");
    return httplib::Server::HandlerResponse::Handled;
  });
  http.Post("/v1/chat/completions",
            [this](const httplib::Request& req, httplib::Response& res) { chat(req, res); });
  http.Get("/v1/models", [this](const httplib::Request& req, httplib::Response& res) {
    if (!authorized(req, res)) return;
    const json models{
        {"object", "list"},
        {"data",
         {{{"id", o_.model_name}, {"object", "model"}, {"created", 0}, {"owned_by", "lvx"}}}}};
    res.set_content(models.dump(), "application/json");
  });
  http.Get("/health", [this](const httplib::Request&, httplib::Response& res) {
    const bool ok = !failed_ && !stopping();
    res.status = ok ? 200 : 503;
    res.set_content(json{{"status", failed_      ? "failed"
                                    : stopping() ? "shutting down"
                                                 : "ok"},
                         {"ranks", pg_.world_size()}}
                        .dump(),
                    "application/json");
  });
  http.Get("/metrics", [this](const httplib::Request& req, httplib::Response& res) {
    if (!o_.metrics_public && !authorized(req, res)) return;
    res.set_content(metrics_text(), "text/plain; version=0.0.4");
  });
  // Errors httplib answers itself (413 for an oversized body, 404 for an unknown path) in
  // OpenAI's shape; those our handlers answered keep their bodies.
  http.set_error_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    const ApiError e =
        res.status == 413
            ? ApiError(413, "invalid_request_error",
                       "the request body is larger than the server's limit of " +
                           std::to_string(o_.max_body_bytes) + " bytes (--max-body-bytes)")
        : res.status == 404 ? ApiError(404, "invalid_request_error",
                                       "no such endpoint: " + req.method + " " + req.path)
                            : ApiError(res.status, "invalid_request_error",
                                       "HTTP error " + std::to_string(res.status));
    res.set_content(e.body_text(), "application/json");
    metrics_.count(e.status);
  });
  http.set_exception_handler(
      [this](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "unknown error";
        try {
          std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        send_error(res, ApiError(500, "server_error", client_error_text(what)));
      });
}

std::string Server::bind() {
  const size_t threads = static_cast<size_t>(std::min<int64_t>(o_.max_queue + 8, 512));
  http_.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
  http_.set_payload_max_length(static_cast<size_t>(o_.max_body_bytes));
  http_.set_read_timeout(300, 0);
  http_.set_write_timeout(300, 0);
  routes(http_);
  port_ = o_.port;
  if (port_ == 0) {
    port_ = http_.bind_to_any_port(o_.host);
    if (port_ <= 0)
      return "cannot listen on " + o_.host + " (--host): not an address of this machine";
  } else if (!http_.bind_to_port(o_.host, port_)) {
    return "cannot listen on " + o_.host + ":" + std::to_string(port_) +
           " (--host, --port): the port is in use or the host is not an address of this machine";
  }
  widen_listen_backlog(port_);
  return "";
}

std::shared_ptr<Job> Server::take_job() {
  std::unique_lock<std::mutex> lock(qmu_);
  if (static_cast<int64_t>(batch_.size()) >= o_.max_batch) return nullptr;
  if (batch_.empty())
    qcv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return !queue_.empty(); });
  if (queue_.empty()) return nullptr;
  std::shared_ptr<Job> job = queue_.front();
  queue_.pop_front();
  return job;
}

void Server::admit(const std::shared_ptr<Job>& job) {
  auto r = std::make_unique<Running>();
  r->command.op = Op::kAnswer;
  r->command.desc = describe(*job, r->command.blobs);
  r->key = generation_key(r->command.desc);
  r->group = {job};
  // Queued requests identical to this one in everything their tokens depend on (media,
  // sampling and seed, conversation, max_tokens) share its generation: the same inputs give
  // the same tokens, so each gets exactly the answer it would get alone. What only their own
  // responses use (stop strings, streaming, usage) stays theirs.
  if (o_.merge_identical) {
    std::lock_guard<std::mutex> lock(qmu_);
    for (auto it = queue_.begin(); it != queue_.end();) {
      std::vector<std::string> blobs;
      if (!(*it)->cancelled && generation_key(describe(**it, blobs)) == r->key &&
          blobs == r->command.blobs) {
        r->group.push_back(*it);
        it = queue_.erase(it);
      } else {
        ++it;
      }
    }
  }
  Running* rp = r.get();
  runtime::AnswerHooks hooks;
  hooks.on_text = [this, rp](const std::string& piece) {
    std::lock_guard<std::mutex> lock(gmu_);
    rp->pieces.push_back(piece);
    for (const auto& j : rp->group) {
      note_first(*j);
      j->push_text(piece);
    }
  };
  hooks.stop_requested = [this, rp] {  // every client of the generation left or has its stop
    std::lock_guard<std::mutex> lock(gmu_);
    const bool all = std::all_of(rp->group.begin(), rp->group.end(), [](const auto& j) {
      return j->cancelled.load() || j->stop_hit;
    });
    if (all) rp->open = false;
    return all;
  };
  {
    std::lock_guard<std::mutex> lock(gmu_);
    r->open = o_.merge_identical;
    running_ += static_cast<int64_t>(r->group.size());
    batch_.push_back(std::move(r));
  }
  exchange(pg_, rp->command);
  rp->answer = start_answer(rp->command, hooks);
  retire_done();  // a video or prompt that failed: done at once
}

void Server::step_batch() {
  Command c;
  c.op = Op::kStep;
  exchange(pg_, c);
  std::vector<runtime::QaAnswer*> step;
  for (auto& r : batch_) step.push_back(r->answer.get());
  {
    std::lock_guard<std::mutex> lock(metrics_.mu);
    ++metrics_.steps;
    metrics_.step_rows += static_cast<int64_t>(step.size());
    metrics_.most_rows = std::max(metrics_.most_rows, static_cast<int64_t>(step.size()));
  }
  session_.step(step);
  retire_done();
}

void Server::retire_done() {
  for (size_t i = 0; i < batch_.size();) {
    Running& r = *batch_[i];
    if (!session_.done(*r.answer)) {
      ++i;
      continue;
    }
    const json row = session_.finish(*r.answer);
    std::unique_ptr<Running> done;
    {
      std::lock_guard<std::mutex> lock(gmu_);
      r.open = false;
      done = std::move(batch_[i]);
      batch_.erase(batch_.begin() + static_cast<std::ptrdiff_t>(i));
      running_ -= static_cast<int64_t>(done->group.size());
      std::lock_guard<std::mutex> qlock(qmu_);
      joined_ -= done->joined;
    }
    complete(*done, row);
  }
}

// The clients of a finished generation: the metrics, then each answer (or the row's error).
void Server::complete(Running& r, const json& row) {
  {
    std::lock_guard<std::mutex> lock(metrics_.mu);
    metrics_.merged += static_cast<int64_t>(r.group.size()) - 1;
    for (const auto& j : r.group) metrics_.cancelled += j->cancelled ? 1 : 0;
    if (!row.contains("error") && row.contains("visual_cache")) {
      metrics_.cache_hits += row["visual_cache"]["hits"].get<int64_t>();
      metrics_.cache_misses += row["visual_cache"]["misses"].get<int64_t>();
      metrics_.prefix_reuses += row["visual_cache"].value("prefix_reused", false) ? 1 : 0;
      metrics_.cache_bytes = row["visual_cache"]["bytes"].get<int64_t>();
    }
  }
  for (const auto& jp : r.group) {
    Job& j = *jp;
    if (row.contains("error")) {
      j.fail(bad_request(client_error_text(row["error"].get<std::string>())));
      continue;
    }
    note_first(j);
    {
      std::lock_guard<std::mutex> lock(metrics_.mu);
      metrics_.prompt_tokens += row["prompt_tokens"].get<int64_t>();
      metrics_.completion_tokens += row["completion_tokens"].get<int64_t>();
      metrics_.latency_sum += seconds_since(j.received);
      ++metrics_.latency_count;
    }
    std::string finish = row["finish_reason"].get<std::string>();
    if (j.stop_hit) finish = "stop";
    // The text as lvx qa gives it, unless a stop string cut it.
    j.finish(row, finish, j.stop_hit ? j.text : row["response"].get<std::string>());
  }
}

int Server::run_rank0() {
  httplib::Server& http = http_;
  const int port = port_;
  std::thread listener([&] { http.listen_after_bind(); });
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  std::cerr << "lvx serve: " << o_.model_name << " on " << pg_.world_size()
            << " rank(s), listening on http://" << o_.host << ":" << port << std::endl;

  const double timeout_s = std::chrono::duration<double>(dist::options_from_env().timeout).count();
  const double heartbeat_s = std::clamp(timeout_s / 4, 0.2, 5.0);
  auto last_command = clock::now();
  int code = 0;
  std::shared_ptr<Job> job;  // the one being admitted
  try {
    for (;;) {
      // Every request waiting, while the batch has room: their question tokens then run in one
      // pass at the next step.
      while ((job = take_job())) {
        if (job->cancelled) {  // its client left while it waited
          std::lock_guard<std::mutex> lock(metrics_.mu);
          ++metrics_.cancelled;
          continue;
        }
        admit(job);
        job.reset();
        last_command = clock::now();
      }
      if (g_stop_signal && !draining_) {
        draining_ = true;
        std::cerr << "lvx serve: stopping: finishing the requests in flight" << std::endl;
      }
      if (!batch_.empty()) {
        step_batch();
        last_command = clock::now();
        continue;
      }
      bool idle = false;
      {
        std::lock_guard<std::mutex> lock(qmu_);
        idle = queue_.empty();
      }
      if (!idle) continue;
      if (draining_) break;
      if (seconds_since(last_command) >= heartbeat_s) {
        Command hb;
        exchange(pg_, hb);
        last_command = clock::now();
      }
    }
    Command bye;
    bye.op = Op::kShutdown;
    exchange(pg_, bye);
    pg_.barrier();
  } catch (const std::exception& e) {
    failure_ = e.what();  // before failed_: HTTP threads read it once they see failed_
    failed_ = true;
    code = 1;
    std::cerr << "lvx serve: " << e.what() << "\nlvx serve: answering 503 and stopping"
              << std::endl;
    const ApiError unavailable(503, "server_error",
                               "a rank failed: " + client_error_text(failure_));
    std::vector<std::shared_ptr<Job>> waiting;
    {
      std::lock_guard<std::mutex> lock(gmu_);
      for (auto& r : batch_) {
        r->open = false;
        waiting.insert(waiting.end(), r->group.begin(), r->group.end());
      }
    }
    if (job) waiting.push_back(job);
    for (const auto& j : waiting) j->fail(unavailable);
    fail_queued(unavailable);
  }
  // Let the responses in flight reach their clients (bounded), then stop listening.
  const auto until = clock::now() + std::chrono::seconds(10);
  while (handlers_ > 0 && clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  http.stop();
  listener.join();
  return code;
}

}  // namespace

int run_serve_rank(const ServeOptions& options) {
  auto pg = dist::ProcessGroup::from_env();
  runtime::QaSession session(options.job, pg, options.cache_bytes);
  // The questions admitted between two steps run their tokens in one pass (one at a time: as
  // lvx qa runs them).
  session.batch_prompts(options.max_batch > 1);
  Server server(options, session);
  const std::vector<std::string> errors =
      dist::gather_errors(*pg, pg->rank() == 0 ? server.bind() : std::string());
  LVX_CHECK(errors[0].empty(), errors[0]);
  return pg->rank() == 0 ? server.run_rank0() : server.run_other_rank();
}

}  // namespace lvx::serve
