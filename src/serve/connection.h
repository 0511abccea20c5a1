// The client's connection as lvx serve's handlers see it. cpp-httplib hands a handler no socket
// and says nothing until a write fails, so a handler that waits (a non-streaming answer, or the
// first text) looks at its connection's socket (client_gone) to cancel the request of a client
// that left. The gate's worker (src/serve/gate.h) names the socket for the request it runs.
#pragma once

namespace lvx::serve {

// The socket of the request this thread handles (-1: none), set by the worker around it.
void set_connection_fd(int fd);
int connection_fd();

// Whether the client at the other end of `fd` closed its side (an end of file waits to be read,
// or the socket failed). A client that sent more bytes (a pipelined request) is still there.
bool client_gone(int fd);

}  // namespace lvx::serve
