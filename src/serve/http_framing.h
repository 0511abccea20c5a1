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

}  // namespace lvx::serve
