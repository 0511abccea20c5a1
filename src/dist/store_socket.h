// The rendezvous store's listening socket, opened by the launcher and handed to rank 0.
//
// A launcher that picks the store's port itself (lvx launch without --master-port) used to ask the
// kernel for a free port, close it, and let rank 0 bind it later: in between, any process on the
// machine could take that port (an ephemeral port of another job's connection, another launch
// choosing the same one), and rank 0 then failed with EADDRINUSE. Seen in CI with two test jobs
// at once. Instead the launcher keeps the socket open and listening, and rank 0's store serves on
// it (c10d's TCPStoreOptions::masterListenFd, as torchrun's agent does for its own store): the
// port is never free between the choice and the store.
#pragma once

#include <string>

namespace lvx::dist {

// The environment variable carrying the socket's descriptor number to rank 0.
inline constexpr const char* kStoreListenFdVar = "LVX_STORE_LISTEN_FD";

// A TCP socket listening on a port the kernel chose, on every address of this network namespace
// (IPv6 with IPv4 mapped where the namespace has IPv6, else IPv4): what c10d's store binds when it
// opens its own port. Closed on destruction and on exec (a rank keeps it only by clearing
// FD_CLOEXEC, see keep_across_exec).
class StoreSocket {
 public:
  StoreSocket();
  ~StoreSocket();
  StoreSocket(const StoreSocket&) = delete;
  StoreSocket& operator=(const StoreSocket&) = delete;

  int fd() const { return fd_; }
  int port() const { return port_; }

  // In a forked child before exec (async-signal-safe, never throws): the socket survives the exec
  // and kStoreListenFdVar names it. Returns false when the flag could not be cleared.
  bool keep_across_exec() const;

 private:
  int fd_ = -1;
  int port_ = 0;
};

// In rank 0: the descriptor `fd_var` (kStoreListenFdVar's value) names, when it is a listening TCP
// socket on `port`; it is then marked close-on-exec again (children rank 0 starts must not hold
// it). -1 otherwise, e.g. a variable inherited from an unrelated parent: the store then binds
// `port` itself, as before.
int adopt_store_socket(const std::string& fd_var, int port);

}  // namespace lvx::dist
