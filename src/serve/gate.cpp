#include "src/serve/gate.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "src/serve/http_framing.h"
#include "src/serve/openai_api.h"

namespace lvx::serve {

namespace {

constexpr size_t kMaxHeaderBytes = 64 << 10;
constexpr int64_t kProbation = 64;  // connections accepted past the bound, for /health
constexpr double kProbationHeaderS = 1, kBodyBaseS = 10, kLingerS = 10;

Gate::clock::time_point after(double seconds) {
  return Gate::clock::now() +
         std::chrono::duration_cast<Gate::clock::duration>(std::chrono::duration<double>(seconds));
}

const char* reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 404:
      return "Not Found";
    case 408:
      return "Request Timeout";
    case 411:
      return "Length Required";
    case 413:
      return "Payload Too Large";
    case 429:
      return "Too Many Requests";
    case 431:
      return "Request Header Fields Too Large";
    case 503:
      return "Service Unavailable";
    default:
      return "Error";
  }
}

}  // namespace

// A connection the gate holds: reading its header, sending the gate's answer, or lingering.
struct Gate::Conn {
  enum State { kHeader, kAnswer, kLinger };
  int fd = -1;
  State state = kHeader;
  std::string in, out;
  size_t sent = 0;
  clock::time_point deadline;
  int64_t linger_left = 0;  // bytes still read and dropped after the answer
  bool probation = false;
};

Gate::Gate(GateOptions o, Judge judge, Handle handle, Count count)
    : o_(std::move(o)),
      judge_(std::move(judge)),
      handle_(std::move(handle)),
      count_(std::move(count)) {}

Gate::~Gate() {
  for (auto& c : conns_) ::close(c->fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
}

std::string Gate::bind() {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  const std::string where = o_.host + ":" + std::to_string(o_.port);
  if (::getaddrinfo(o_.host.c_str(), std::to_string(o_.port).c_str(), &hints, &res) != 0 || !res)
    return "cannot listen on " + o_.host + " (--host): not an address of this machine";
  std::string error;
  for (addrinfo* a = res; a && listen_fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    const int yes = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &yes, sizeof yes);  // accepted sockets inherit it
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, SOMAXCONN) == 0) {
      listen_fd_ = fd;
    } else {
      error = std::strerror(errno);
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  if (listen_fd_ < 0)
    return "cannot listen on " + where +
           " (--host, --port): " + (error.empty() ? "no usable address" : error) +
           " (the port is in use or the host is not an address of this machine)";
  sockaddr_storage a{};
  socklen_t n = sizeof a;
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &n);
  port_ = ntohs(a.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&a)->sin6_port
                                        : reinterpret_cast<sockaddr_in*>(&a)->sin_port);
  char host[NI_MAXHOST] = {0};
  address_ = ::getnameinfo(reinterpret_cast<sockaddr*>(&a), n, host, sizeof host, nullptr, 0,
                           NI_NUMERICHOST) == 0
                 ? (a.ss_family == AF_INET6 ? "[" + std::string(host) + "]" : std::string(host))
                 : o_.host;
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  return "";
}

void Gate::run() {
  for (int64_t i = 0; i < o_.workers; ++i) workers_.emplace_back([this] { work(); });
  while (!stop_) poll_once();
  for (auto& c : conns_) close_conn(*c);
  conns_.clear();
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const int fd : held_) ::shutdown(fd, SHUT_RDWR);  // no worker waits on a client now
  }
  cv_.notify_all();
  for (auto& w : workers_) w.join();
  for (auto& [fd, unread] : returned_) ::close(fd);
}

void Gate::stop() {
  stop_ = true;
  const uint64_t one = 1;
  if (wake_fd_ >= 0) (void)::write(wake_fd_, &one, sizeof one);
}

void Gate::poll_once() {
  conns_.erase(
      std::remove_if(conns_.begin(), conns_.end(), [](const auto& c) { return c->fd < 0; }),
      conns_.end());
  std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
  clock::time_point next = after(1.0);
  for (const auto& c : conns_) {
    fds.push_back({c->fd, static_cast<short>(c->state == Conn::kAnswer ? POLLOUT : POLLIN), 0});
    next = std::min(next, c->deadline);
  }
  const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - clock::now());
  ::poll(fds.data(), fds.size(), static_cast<int>(std::max<int64_t>(wait.count() + 1, 0)));
  if (fds[1].revents) {
    uint64_t v;
    while (::read(wake_fd_, &v, sizeof v) > 0) {
    }
  }
  // Connections first (in the order polled: those accepted below are polled next turn).
  const auto now = clock::now();
  for (size_t i = 0; i < conns_.size() && i + 2 < fds.size(); ++i) {
    Conn& c = *conns_[i];
    if (fds[i + 2].revents & (POLLIN | POLLHUP | POLLERR)) {
      if (c.state == Conn::kAnswer)
        close_conn(c);  // the client hung up before reading it
      else
        on_readable(c);
    } else if (fds[i + 2].revents & POLLOUT) {
      on_writable(c);
    }
    if (c.fd >= 0) expire(c, now);
  }
  take_returned();
  if (fds[0].revents & POLLIN) accept_all();
}

void Gate::accept_all() {
  for (;;) {
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) return;
    if (open_ >= o_.max_connections + kProbation && !evict_probation()) {
      ::close(fd);
      count_(503);
      continue;
    }
    auto c = std::make_unique<Conn>();
    c->fd = fd;
    c->probation = open_ >= o_.max_connections;
    c->deadline = after(c->probation ? kProbationHeaderS : o_.header_timeout_s);
    ++open_;
    conns_.push_back(std::move(c));
  }
}

bool Gate::evict_probation() {
  for (auto& c : conns_)  // the oldest first: conns_ keeps the order they came in
    if (c->fd >= 0 && c->probation && c->state == Conn::kHeader) {
      static const std::string busy =
          "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
      (void)::send(c->fd, busy.data(), busy.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
      count_(503);
      close_conn(*c);
      return true;
    }
  return false;
}

void Gate::on_readable(Conn& c) {
  if (c.state == Conn::kLinger) {
    char drop[64 << 10];
    const ssize_t n = ::recv(c.fd, drop, sizeof drop, MSG_DONTWAIT);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return close_conn(c);
    if (n > 0 && (c.linger_left -= n) <= 0) close_conn(c);
    return;
  }
  char buf[16 << 10];
  const ssize_t n = ::recv(c.fd, buf, sizeof buf, MSG_DONTWAIT);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) return close_conn(c);
  if (n < 0) return;
  const size_t from = c.in.size() >= 3 ? c.in.size() - 3 : 0;
  c.in.append(buf, static_cast<size_t>(n));
  const size_t end = c.in.find("\r\n\r\n", from);
  if (end != std::string::npos) return judge_header(c, end + 4);
  if (c.in.size() > kMaxHeaderBytes)
    answer_error(c, 431, "the request header is over " + std::to_string(kMaxHeaderBytes) + " bytes",
                 0);
}

void Gate::judge_header(Conn& c, size_t header_end) {
  std::optional<httplib::Request> head = parse_head(c.in.substr(0, header_end));
  if (!head) return answer_error(c, 400, "malformed request line or header", 0);
  const int64_t body = declared_body_bytes(*head, o_.linger_bytes);
  const bool probe = head->method == "GET" && (head->path == "/health" || head->path == "/metrics");
  if (c.probation && !probe)
    return answer_error(c, 503, "the server has too many open connections: try again later", body);
  Verdict v = judge_(*head);
  if (v.status != 0) return answer(c, v.status, v.body, v.content_type, v.headers, body);
  std::unique_lock<std::mutex> lock(mu_);
  if (busy_ + static_cast<int64_t>(tasks_.size()) >= o_.workers) {
    lock.unlock();
    return answer_error(c, 503, "every request thread of the server is busy: try again later",
                        body);
  }
  const double body_s = kBodyBaseS + static_cast<double>(body) / o_.body_min_rate;
  tasks_.push_back({c.fd, std::move(c.in), after(body_s), std::move(v.reserved)});
  held_.insert(c.fd);
  lock.unlock();
  cv_.notify_one();
  c.fd = -1;  // the worker's now (still counted open)
}

void Gate::answer(Conn& c, int status, const std::string& body, const std::string& content_type,
                  const std::vector<std::pair<std::string, std::string>>& headers,
                  int64_t body_bytes) {
  std::string out = "HTTP/1.1 " + std::to_string(status) + " " + reason(status) +
                    "\r\nContent-Type: " + content_type +
                    "\r\nContent-Length: " + std::to_string(body.size()) +
                    "\r\nConnection: close\r\n";
  for (const auto& [k, v] : headers) out += k + ": " + v + "\r\n";
  c.out = out + "\r\n" + body;
  c.sent = 0;
  c.state = Conn::kAnswer;
  // The body the client may still send, read and dropped once the answer is out (below the
  // header's end, what was read already counts).
  c.linger_left = std::min(body_bytes, o_.linger_bytes);
  c.deadline = after(kLingerS);
  on_writable(c);
}

void Gate::answer_error(Conn& c, int status, const std::string& message, int64_t body_bytes) {
  count_(status);
  std::vector<std::pair<std::string, std::string>> h;
  if (status == 503) h.emplace_back("Retry-After", "1");
  const std::string type = status == 503 ? "server_error" : "invalid_request_error";
  answer(c, status, ApiError(status, type, message).body_text(), "application/json", h, body_bytes);
}

void Gate::on_writable(Conn& c) {
  while (c.sent < c.out.size()) {
    const ssize_t n =
        ::send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n <= 0) return close_conn(c);
    c.sent += static_cast<size_t>(n);
  }
  if (c.linger_left <= 0) return close_conn(c);
  ::shutdown(c.fd, SHUT_WR);  // the answer is whole; what the client still sends is dropped
  c.state = Conn::kLinger;
  c.deadline = after(kLingerS);
}

void Gate::expire(Conn& c, clock::time_point now) {
  if (now < c.deadline) return;
  if (c.state == Conn::kHeader && !c.in.empty())
    return answer_error(c, 408, "the request header did not arrive in time (--header-timeout)", 0);
  close_conn(c);  // an idle kept-alive connection, an answer unread, a linger over
}

void Gate::close_conn(Conn& c) {
  if (c.fd < 0) return;
  ::close(c.fd);
  c.fd = -1;
  --open_;
}

void Gate::take_returned() {
  std::vector<std::pair<int, std::string>> back;
  {
    std::lock_guard<std::mutex> lock(mu_);
    back.swap(returned_);
  }
  for (auto& [fd, unread] : back) {
    auto c = std::make_unique<Conn>();
    c->fd = fd;
    c->in = std::move(unread);
    c->deadline = after(o_.header_timeout_s);
    conns_.push_back(std::move(c));
    const size_t end = conns_.back()->in.find("\r\n\r\n");
    if (end != std::string::npos) judge_header(*conns_.back(), end + 4);  // pipelined
  }
}

void Gate::work() {
  for (;;) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
    if (tasks_.empty()) return;
    Task t = std::move(tasks_.front());
    tasks_.pop_front();
    ++busy_;
    lock.unlock();
    ConnectionStream s(t.fd, std::move(t.head), t.body_deadline, o_.write_timeout);
    bool again = false;
    try {
      again = handle_(s, std::move(t.reserved));
    } catch (...) {  // handlers answer their own errors: this is a write to a client gone
    }
    again = again && !s.timed_out() && !s.broken() && !stop_;
    if (s.timed_out()) count_(408);
    lock.lock();
    --busy_;
    held_.erase(t.fd);
    lock.unlock();
    if (again) {
      give_back(t.fd, s.unread());
    } else {
      ::close(t.fd);
      --open_;
    }
  }
}

void Gate::give_back(int fd, std::string unread) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    returned_.emplace_back(fd, std::move(unread));
  }
  const uint64_t one = 1;
  (void)::write(wake_fd_, &one, sizeof one);
}

}  // namespace lvx::serve
