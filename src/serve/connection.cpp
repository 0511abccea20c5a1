// The client's connection; see connection.h.
#include "src/serve/connection.h"

#include <poll.h>
#include <sys/socket.h>

#include <cerrno>

namespace lvx::serve {

namespace {
thread_local int t_connection_fd = -1;
}  // namespace

void set_connection_fd(int fd) { t_connection_fd = fd; }

int connection_fd() { return t_connection_fd; }

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

}  // namespace lvx::serve
