#include "src/dist/store_socket.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "src/common/error.h"

namespace lvx::dist {
namespace {

// A listening socket of `family` on its wildcard address and a kernel-chosen port; -1 when the
// family is unavailable here (a namespace without IPv6).
int listen_any(int family) {
  const int fd = ::socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_storage addr{};
  socklen_t len = 0;
  if (family == AF_INET6) {
    const int off = 0;  // IPv4 clients too, as c10d's own dual-stack listener
    ::setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &off, sizeof(off));
    auto* a6 = reinterpret_cast<sockaddr_in6*>(&addr);
    a6->sin6_family = AF_INET6;
    a6->sin6_addr = in6addr_any;
    len = sizeof(sockaddr_in6);
  } else {
    auto* a4 = reinterpret_cast<sockaddr_in*>(&addr);
    a4->sin_family = AF_INET;
    a4->sin_addr.s_addr = htonl(INADDR_ANY);
    len = sizeof(sockaddr_in);
  }
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0 || ::listen(fd, SOMAXCONN) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// The local port of socket `fd`; 0 when it has none.
int local_port(int fd) {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) return 0;
  if (addr.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port);
  if (addr.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return 0;
}

bool is_listening_stream(int fd) {
  int listening = 0, type = 0;
  socklen_t n = sizeof(int), m = sizeof(int);
  return ::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &n) == 0 && listening == 1 &&
         ::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &m) == 0 && type == SOCK_STREAM;
}

}  // namespace

StoreSocket::StoreSocket() {
  fd_ = listen_any(AF_INET6);
  if (fd_ < 0) fd_ = listen_any(AF_INET);
  LVX_CHECK(fd_ >= 0, "launch: cannot open a listening socket for the rendezvous store: ",
            std::strerror(errno));
  port_ = local_port(fd_);
}

StoreSocket::~StoreSocket() {
  if (fd_ >= 0) ::close(fd_);
}

bool StoreSocket::keep_across_exec() const {
  const int flags = ::fcntl(fd_, F_GETFD);
  return flags >= 0 && ::fcntl(fd_, F_SETFD, flags & ~FD_CLOEXEC) == 0;
}

int adopt_store_socket(const std::string& fd_var, int port) {
  if (fd_var.empty()) return -1;
  int fd = -1;
  try {
    size_t used = 0;
    fd = std::stoi(fd_var, &used);
    if (used != fd_var.size()) return -1;
  } catch (const std::exception&) {
    return -1;
  }
  if (fd < 0 || !is_listening_stream(fd) || local_port(fd) != port) return -1;
  ::fcntl(fd, F_SETFD, ::fcntl(fd, F_GETFD) | FD_CLOEXEC);
  return fd;
}

}  // namespace lvx::dist
