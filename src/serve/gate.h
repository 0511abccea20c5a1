// lvx serve's front door: the listening socket and every connection until its request's header
// is read and judged. One thread polls all of them, so a connection costs the server a few
// kilobytes and a slot in the poll set, never a thread, until its request has been admitted:
//   - the whole header has one deadline (--header-timeout; a kept-alive connection's next request
//     too): a client that trickles its header is answered 408 and closed;
//   - the owner judges each header on this thread (Judge, before a byte of the body is read):
//     /health and /metrics are answered here, within the poll loop's turn, whatever the HTTP
//     workers are doing; a request without the API key, malformed framing or a body that does not
//     fit the in-flight budget is refused here too;
//   - a refusal is sent whole, then the connection lingers (reads and discards what the client
//     still sends, up to --max-body-bytes and 10 s, as nginx's lingering close), so a client that
//     is still uploading reads the status instead of a reset;
//   - an admitted request goes to one of `workers` threads (cpp-httplib's request processing on a
//     ConnectionStream, with the body's deadline: its declared length at --body-min-rate, plus
//     10 s); when every worker is busy it is answered 503 here;
//   - at most max_connections are open; 64 more are accepted on probation (1 s for a header, and
//     only /health and /metrics are answered; anything else gets 503); beyond those a new
//     connection takes the place of the oldest on probation, so a health check always gets in.
// cpp-httplib 0.11 (Debian 12's) reads headers on its worker threads with a per-read timeout and
// reserves nothing before them, so 100 slow clients took all of its threads (lvx serve's health
// check timed out) and two unauthenticated uploads held the whole in-flight budget. Its request
// processing (routes, bodies, chunked streams) is kept: process_request is a protected member,
// reached through a subclass (server.cpp).
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <utility>
#include <vector>

#include "src/serve/connection_stream.h"
#include "src/serve/inflight_budget.h"

namespace lvx::serve {

struct GateOptions {
  std::string host = "127.0.0.1";
  int port = 0;
  int64_t max_connections = 256;
  int64_t workers = 72;
  double header_timeout_s = 5;
  double body_min_rate = 1 << 20;  // bytes/s the whole body must average, after 10 s
  int64_t linger_bytes = int64_t{512} << 20;
  std::chrono::milliseconds write_timeout{300'000};
};

// What the owner makes of a request's header: an answer the gate sends (status != 0), or the
// request admitted with the bytes it reserved.
struct Verdict {
  int status = 0;
  std::string body, content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;
  InflightBudget::Reservation reserved;
};

class Gate {
 public:
  using clock = std::chrono::steady_clock;
  // Runs on the gate's thread: must not block.
  using Judge = std::function<Verdict(const httplib::Request& head)>;
  // Runs on a worker: processes the request (its header replayed by the stream) and answers it;
  // returns whether the connection may carry another request.
  using Handle = std::function<bool(ConnectionStream& stream, InflightBudget::Reservation)>;
  // Counts a status the gate answered on its own (408, 431, 400, 503).
  using Count = std::function<void(int status)>;

  Gate(GateOptions o, Judge judge, Handle handle, Count count);
  ~Gate();
  // Listens on host:port (port 0: any free one): "" or what went wrong.
  std::string bind();
  int port() const { return port_; }
  // The address the socket is bound to, as a URL's host ("127.0.0.1", "[::1]"): --host's, or the
  // one an emulated cluster's node binds its ephemeral listeners to (src/dist/emulated_cluster.h:
  // `serve --port 0` under `lvx launch --inter-node` listens on 127.0.1.1).
  const std::string& address() const { return address_; }
  int listening_fd() const { return listen_fd_; }
  // The poll loop and the workers, until stop(); returns once every worker has ended.
  void run();
  void stop();
  int64_t open_connections() const { return open_; }

 private:
  struct Conn;
  struct Task {
    int fd;
    std::string head;
    clock::time_point body_deadline;
    InflightBudget::Reservation reserved;
  };
  void poll_once();
  void accept_all();
  // Closes the oldest connection on probation that is still sending its header (503): a new
  // connection past every bound takes its place. Whether there was one.
  bool evict_probation();
  void on_readable(Conn& c);
  void on_writable(Conn& c);
  void judge_header(Conn& c, size_t header_end);
  void answer(Conn& c, int status, const std::string& body, const std::string& content_type,
              const std::vector<std::pair<std::string, std::string>>& headers, int64_t body_bytes);
  void answer_error(Conn& c, int status, const std::string& message, int64_t body_bytes);
  void expire(Conn& c, clock::time_point now);
  void close_conn(Conn& c);
  void take_returned();
  void work();
  void give_back(int fd, std::string unread);

  GateOptions o_;
  Judge judge_;
  Handle handle_;
  Count count_;
  int listen_fd_ = -1, wake_fd_ = -1, port_ = 0;
  std::string address_;
  std::vector<std::unique_ptr<Conn>> conns_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> open_{0};
  // Worker side: tasks waiting, workers busy, connections handed back for their next request,
  // and the sockets workers hold (shut down at stop, so no worker waits on a client then).
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;
  int64_t busy_ = 0;
  std::vector<std::pair<int, std::string>> returned_;
  std::unordered_set<int> held_;
  std::vector<std::thread> workers_;
};

}  // namespace lvx::serve
