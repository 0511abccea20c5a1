// HTTP/1.1 message framing checked from the headers alone, before a byte of the body is read
// (RFC 9112 §6: Content-Length and Transfer-Encoding). cpp-httplib 0.11 reads the body first and
// judges it after: a POST without Content-Length, a negative or 2^64 Content-Length, a declared
// size over the limit or `Transfer-Encoding: gzip, chunked` each held one of the server's HTTP
// threads until the 300 s read timeout, and two Content-Length headers were accepted (request
// smuggling's ingredient). Run from the pre-routing handler, this answers such requests at once
// and closes the connection (its unread body cannot be told from the next request).
#pragma once

#include <httplib.h>

#include <cstdint>
#include <optional>

#include "src/serve/openai_api.h"

namespace lvx::serve {

// The error for a request whose framing is malformed or over `max_body_bytes`, or nothing:
//   400  two Content-Length headers, one that is not a decimal number of at most 18 digits,
//        Transfer-Encoding other than exactly `chunked`, or both Transfer-Encoding and
//        Content-Length
//   411  a POST, PUT or PATCH with neither Content-Length nor chunked Transfer-Encoding
//   413  a declared Content-Length over max_body_bytes
std::optional<ApiError> framing_error(const httplib::Request& req, int64_t max_body_bytes);

// A request's header (the request line and the header fields, through the blank line) as
// cpp-httplib's Request: method, target, path (the target before '?'), version and headers;
// nothing when the request line is not `METHOD SP target SP HTTP/1.x` or a field has no name,
// no colon or a folded line (RFC 9112 §5.2: obsolete, refused).
std::optional<httplib::Request> parse_head(const std::string& head);

// The bytes a request will send as its body, from its headers: its Content-Length, or
// `max_body_bytes` for a chunked one (its size is not known before it is read). For a request
// framing_error accepted.
int64_t declared_body_bytes(const httplib::Request& req, int64_t max_body_bytes);

}  // namespace lvx::serve
