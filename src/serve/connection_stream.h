// One client connection as cpp-httplib's Stream, for a request the gate (gate.h) has already read
// the header of: httplib::Server::process_request parses that header again from `head` (bytes the
// gate read, header first and maybe the body's start), then reads the rest of the body from the
// socket, and writes its response to it.
//
// Why not cpp-httplib's own SocketStream: its reads wait per call (the 300 s read timeout), so a
// client that sends one byte every few minutes holds an HTTP thread, and its body bytes, forever.
// Here the whole body has one deadline (the gate sets it from the declared length and a floor
// rate); past it the client gets 408 and the connection is closed. Reads never take more than
// asked from the socket, so bytes after the request (a pipelined next request) stay unread for
// the gate.
#pragma once

#include <httplib.h>

#include <chrono>
#include <string>

namespace lvx::serve {

class ConnectionStream : public httplib::Stream {
 public:
  using clock = std::chrono::steady_clock;
  // `write_timeout`: the longest one write may wait for the client to read.
  ConnectionStream(int fd, std::string head, clock::time_point body_deadline,
                   std::chrono::milliseconds write_timeout)
      : fd_(fd), head_(std::move(head)), deadline_(body_deadline), write_timeout_(write_timeout) {}

  bool is_readable() const override;
  bool is_writable() const override;
  ssize_t read(char* ptr, size_t size) override;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  int socket() const override { return fd_; }

  // The body missed its deadline: 408 was written, and nothing else will be.
  bool timed_out() const { return timed_out_; }
  // A write failed (the client left): the connection cannot carry another request.
  bool broken() const { return broken_; }
  // Bytes the gate read that the request did not use (the start of a pipelined request).
  std::string unread() const { return head_.substr(used_); }

 private:
  // Waits until the socket has bytes (or the deadline passes: then 408 is written).
  bool wait_readable() const;
  void answer_timeout();

  int fd_;
  std::string head_;
  size_t used_ = 0;
  clock::time_point deadline_;
  std::chrono::milliseconds write_timeout_;
  mutable bool timed_out_ = false;
  bool broken_ = false;
};

}  // namespace lvx::serve
