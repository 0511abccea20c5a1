// liblvx_emulated_node.so: preloaded (LD_PRELOAD) into every rank of an emulated cluster
// (src/dist/emulated_cluster.h), so that all of a rank's loopback traffic carries its emulated
// node's address and tc can tell inter-node from intra-node traffic by the /24 of both ends.
//
// Why a preload: the kernel gives an unbound socket that connects to 127.x.y.z the source address
// 127.0.0.1, whatever process made it, and neither Gloo's connecting side (gloo/transport/tcp/
// helpers.h, ConnectOperation: socket, then connect, no bind), nor c10d's store client, nor
// torch.distributed's own Gloo group in a Python rank take a source address. This library binds
// for them, without changing any of them:
//   connect()  an IPv4 socket not yet bound, connecting to 127.0.0.0/8, is first bound to
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

}  // namespace

extern "C" int connect(int fd, const sockaddr* addr, socklen_t len) {
  static const auto real = reinterpret_cast<connect_fn>(dlsym(RTLD_NEXT, "connect"));
  const in_addr_t self = node_address();
  if (self != 0 && addr != nullptr && addr->sa_family == AF_INET &&
      len >= static_cast<socklen_t>(sizeof(sockaddr_in)) &&
      is_loopback(reinterpret_cast<const sockaddr_in*>(addr)->sin_addr.s_addr)) {
    sockaddr_in cur{};
    socklen_t cl = sizeof(cur);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&cur), &cl) == 0 &&
        cur.sin_family == AF_INET && cur.sin_addr.s_addr == htonl(INADDR_ANY) &&
        cur.sin_port == 0) {
      const int one = 1;
      setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one));
      sockaddr_in b{};
      b.sin_family = AF_INET;
      b.sin_addr.s_addr = self;
      b.sin_port = 0;
      static const auto real_bind = reinterpret_cast<bind_fn>(dlsym(RTLD_NEXT, "bind"));
      real_bind(fd, reinterpret_cast<const sockaddr*>(&b), sizeof(b));  // failure: as before
    }
  }
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
