// liblvx_emulated_node.so: preloaded (LD_PRELOAD) into every rank of an emulated cluster
// (src/dist/emulated_cluster.h), so that all of a rank's loopback traffic carries its emulated
// node's address and tc can tell inter-node from intra-node traffic by the /24 of both ends.
//
// Why a preload: the kernel gives an unbound socket that connects to 127.x.y.z the source address
// 127.0.0.1, whatever process made it, and neither Gloo's connecting side (gloo/transport/tcp/
// helpers.h, ConnectOperation: socket, then connect, no bind), nor c10d's store client, nor
// torch.distributed's own Gloo group in a Python rank take a source address. This library binds
// for them, without changing any of them:
//   connect()  a socket not yet bound, connecting to 127.0.0.0/8 (IPv4, or IPv6-mapped
//              ::ffff:127.x.y.z as c10d's store client does), is first bound to
//              LVX_BIND_ADDRESS (port chosen at connect: IP_BIND_ADDRESS_NO_PORT);
//   bind()     an IPv4 bind to 127.0.0.1 or 0.0.0.0 with port 0 (an ephemeral listener, such as
//              Gloo's device listener when torch resolved no address but loopback) binds to
//              LVX_BIND_ADDRESS instead. Binds to a given port (a server: the rendezvous store,
//              lvx serve) are left alone.
// Without LVX_BIND_ADDRESS (or with an unparsable one) both calls pass through unchanged.
// Plain C ABI, no dependencies beyond libc and libdl.
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

namespace {

using connect_fn = int (*)(int, const sockaddr*, socklen_t);
using bind_fn = int (*)(int, const sockaddr*, socklen_t);

// This rank's address (network byte order), or 0 when there is none.
in_addr_t node_address() {
  static const in_addr_t addr = [] {
    const char* s = getenv("LVX_BIND_ADDRESS");
    in_addr a{};
    if (s == nullptr || inet_pton(AF_INET, s, &a) != 1) return in_addr_t{0};
    return a.s_addr;
  }();
  return addr;
}

bool is_loopback(in_addr_t a) { return (ntohl(a) >> 24) == 127; }

// An IPv6 address that maps an IPv4 loopback one (::ffff:127.x.y.z): c10d's store client
// resolves MASTER_ADDR to that on a dual-stack socket.
bool is_mapped_loopback(const in6_addr& a) {
  return IN6_IS_ADDR_V4MAPPED(&a) && a.s6_addr[12] == 127;
}

// Binds an unbound socket to this rank's address before it connects to `addr`.
void bind_before_connect(int fd, const sockaddr* addr, socklen_t len, in_addr_t self) {
  using bind_fn_t = int (*)(int, const sockaddr*, socklen_t);
  static const auto real_bind = reinterpret_cast<bind_fn_t>(dlsym(RTLD_NEXT, "bind"));
  const int one = 1;
  if (addr->sa_family == AF_INET && len >= static_cast<socklen_t>(sizeof(sockaddr_in)) &&
      is_loopback(reinterpret_cast<const sockaddr_in*>(addr)->sin_addr.s_addr)) {
    sockaddr_in cur{};
    socklen_t cl = sizeof(cur);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&cur), &cl) != 0 ||
        cur.sin_family != AF_INET || cur.sin_addr.s_addr != htonl(INADDR_ANY) || cur.sin_port != 0)
      return;
    setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
    sockaddr_in b{};
    b.sin_family = AF_INET;
    b.sin_addr.s_addr = self;
    real_bind(fd, reinterpret_cast<const sockaddr*>(&b), sizeof(b));  // failure: as before
  } else if (addr->sa_family == AF_INET6 && len >= static_cast<socklen_t>(sizeof(sockaddr_in6)) &&
             is_mapped_loopback(reinterpret_cast<const sockaddr_in6*>(addr)->sin6_addr)) {
    sockaddr_in6 cur{};
    socklen_t cl = sizeof(cur);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&cur), &cl) != 0 ||
        cur.sin6_family != AF_INET6 || !IN6_IS_ADDR_UNSPECIFIED(&cur.sin6_addr) ||
        cur.sin6_port != 0)
      return;
    setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
    sockaddr_in6 b{};
    b.sin6_family = AF_INET6;
    b.sin6_addr.s6_addr[10] = b.sin6_addr.s6_addr[11] = 0xff;
    memcpy(&b.sin6_addr.s6_addr[12], &self, 4);
    real_bind(fd, reinterpret_cast<const sockaddr*>(&b), sizeof(b));
  }
}

}  // namespace

extern "C" int connect(int fd, const sockaddr* addr, socklen_t len) {
  static const auto real = reinterpret_cast<connect_fn>(dlsym(RTLD_NEXT, "connect"));
  const in_addr_t self = node_address();
  if (self != 0 && addr != nullptr) bind_before_connect(fd, addr, len, self);
  return real(fd, addr, len);
}

extern "C" int bind(int fd, const sockaddr* addr, socklen_t len) {
  static const auto real = reinterpret_cast<bind_fn>(dlsym(RTLD_NEXT, "bind"));
  const in_addr_t self = node_address();
  if (self != 0 && addr != nullptr && addr->sa_family == AF_INET &&
      len >= static_cast<socklen_t>(sizeof(sockaddr_in))) {
    const auto* in = reinterpret_cast<const sockaddr_in*>(addr);
    const in_addr_t a = in->sin_addr.s_addr;
    if (in->sin_port == 0 && (a == htonl(INADDR_LOOPBACK) || a == htonl(INADDR_ANY))) {
      sockaddr_in b = *in;
      b.sin_addr.s_addr = self;
      return real(fd, reinterpret_cast<const sockaddr*>(&b), sizeof(b));
    }
  }
  return real(fd, addr, len);
}
