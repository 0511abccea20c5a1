// The client's connection as lvx serve's handlers see it. cpp-httplib 0.11 hands a handler no
// socket and says nothing until a write fails, so a handler that waits (a non-streaming answer,
// or the first text) finds its connection's socket among the process's descriptors by its two
// ends and looks at it (client_gone) to cancel the request of a client that left. And the
// listening socket's backlog, widened past cpp-httplib's 5.
#pragma once

namespace httplib {
struct Request;
}

namespace lvx::serve {

// The socket of `req`'s connection (found by its local and remote address and port, unique while
// the connection is open), or -1 when none matches.
int connection_fd(const httplib::Request& req);

// Whether the client at the other end of `fd` closed its side (an end of file waits to be read,
// or the socket failed). A client that sent more bytes (a pipelined request) is still there.
bool client_gone(int fd);

// Listens again on the bound socket of `port` with the kernel's cap (net.core.somaxconn) as the
// backlog.
void widen_listen_backlog(int port);

}  // namespace lvx::serve
