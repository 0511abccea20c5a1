// The client's connection; see connection.h.
#include "src/serve/connection.h"

#include <dirent.h>
#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <string>

namespace lvx::serve {

namespace {

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

}  // namespace

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

}  // namespace lvx::serve
