#include "src/serve/connection_stream.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "src/serve/openai_api.h"

namespace lvx::serve {

namespace {

int millis_until(ConnectionStream::clock::time_point t) {
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      t - ConnectionStream::clock::now())
                      .count();
  return static_cast<int>(std::clamp<int64_t>(ms, 0, 60'000));
}

void socket_end(int fd, bool peer, std::string& ip, int& port) {
  sockaddr_storage a{};
  socklen_t n = sizeof(a);
  auto* sa = reinterpret_cast<sockaddr*>(&a);
  if ((peer ? ::getpeername(fd, sa, &n) : ::getsockname(fd, sa, &n)) != 0) return;
  char h[NI_MAXHOST], p[NI_MAXSERV];
  if (::getnameinfo(sa, n, h, sizeof(h), p, sizeof(p), NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return;
  ip = h;
  port = std::atoi(p);
}

}  // namespace

bool ConnectionStream::wait_readable() const {
  if (timed_out_) return false;
  for (;;) {
    pollfd p{fd_, POLLIN, 0};
    const int n = ::poll(&p, 1, millis_until(deadline_));
    if (n > 0) return true;
    if (n < 0 && errno == EINTR) continue;
    if (n == 0 && clock::now() < deadline_) continue;  // a wait shorter than the deadline
    if (n == 0) const_cast<ConnectionStream*>(this)->answer_timeout();
    return false;
  }
}

void ConnectionStream::answer_timeout() {
  timed_out_ = true;
  const std::string body =
      ApiError(408, "invalid_request_error",
               "the request body did not arrive in time (the server reads a body at a floor rate: "
               "--body-min-rate)")
          .body_text();
  const std::string msg = "HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                          "Connection: close\r\nContent-Length: " +
                          std::to_string(body.size()) + "\r\n\r\n" + body;
  // Best effort, without waiting: a client this slow may not read it either.
  (void)::send(fd_, msg.data(), msg.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

bool ConnectionStream::is_readable() const {
  return used_ < head_.size() || wait_readable();
}

bool ConnectionStream::is_writable() const {
  if (timed_out_ || broken_) return false;
  pollfd p{fd_, POLLOUT, 0};
  return ::poll(&p, 1, static_cast<int>(write_timeout_.count())) > 0 &&
         (p.revents & (POLLERR | POLLHUP | POLLNVAL)) == 0;
}

ssize_t ConnectionStream::read(char* ptr, size_t size) {
  if (used_ < head_.size()) {
    const size_t n = std::min(size, head_.size() - used_);
    std::memcpy(ptr, head_.data() + used_, n);
    used_ += n;
    return static_cast<ssize_t>(n);
  }
  for (;;) {
    if (!wait_readable()) return -1;
    const ssize_t n = ::recv(fd_, ptr, size, MSG_DONTWAIT);
    if (n >= 0) return n;
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) return -1;
  }
}

ssize_t ConnectionStream::write(const char* ptr, size_t size) {
  // After a 408 cpp-httplib answers the failed read itself: that answer is dropped.
  if (timed_out_) return static_cast<ssize_t>(size);
  if (broken_) return -1;
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::send(fd_, ptr + done, size - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) break;
    pollfd p{fd_, POLLOUT, 0};
    if (::poll(&p, 1, static_cast<int>(write_timeout_.count())) <= 0) break;
  }
  if (done == size) return static_cast<ssize_t>(size);
  broken_ = true;
  return -1;
}

void ConnectionStream::get_remote_ip_and_port(std::string& ip, int& port) const {
  socket_end(fd_, true, ip, port);
}

void ConnectionStream::get_local_ip_and_port(std::string& ip, int& port) const {
  socket_end(fd_, false, ip, port);
}

}  // namespace lvx::serve
