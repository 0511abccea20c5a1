#include "src/serve/http_framing.h"

#include <algorithm>
#include <cctype>
#include <string>

namespace lvx::serve {
namespace {

std::string trimmed_lower(std::string s) {
  const auto not_space = [](unsigned char c) { return !std::isspace(c); };
  s.erase(s.begin(), std::find_if(s.begin(), s.end(), not_space));
  s.erase(std::find_if(s.rbegin(), s.rend(), not_space).base(), s.end());
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

// Content-Length = 1*DIGIT; more than 18 digits cannot be a size this server reads.
bool is_length(const std::string& s) {
  return !s.empty() && s.size() <= 18 &&
         std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isdigit(c); });
}

ApiError framing(int status, const std::string& message) {
  return ApiError(status, "invalid_request_error", message);
}

}  // namespace

std::optional<ApiError> framing_error(const httplib::Request& req, int64_t max_body_bytes) {
  const size_t lengths = req.get_header_value_count("Content-Length");
  const size_t encodings = req.get_header_value_count("Transfer-Encoding");
  if (lengths > 1) return framing(400, "more than one Content-Length header");
  if (encodings > 1) return framing(400, "more than one Transfer-Encoding header");
  if (encodings == 1) {
    if (trimmed_lower(req.get_header_value("Transfer-Encoding")) != "chunked")
      return framing(400, "unsupported Transfer-Encoding (only chunked is accepted)");
    if (lengths == 1)
      return framing(400, "both Transfer-Encoding and Content-Length headers");
    return std::nullopt;
  }
  if (lengths == 1) {
    const std::string value = trimmed_lower(req.get_header_value("Content-Length"));
    if (!is_length(value)) return framing(400, "Content-Length is not a byte count");
    if (std::stoll(value) > max_body_bytes)
      return framing(413, "the request body is larger than the server's limit of " +
                              std::to_string(max_body_bytes) + " bytes (--max-body-bytes)");
    return std::nullopt;
  }
  if (req.method == "POST" || req.method == "PUT" || req.method == "PATCH")
    return framing(411, "a request body needs a Content-Length header (or chunked encoding)");
  return std::nullopt;
}

std::optional<httplib::Request> parse_head(const std::string& head) {
  httplib::Request r;
  size_t line_end = head.find("\r\n");
  if (line_end == std::string::npos) return std::nullopt;
  const std::string line = head.substr(0, line_end);
  const size_t a = line.find(' '), b = line.rfind(' ');
  if (a == std::string::npos || a == 0 || b <= a + 1) return std::nullopt;
  r.method = line.substr(0, a);
  r.target = line.substr(a + 1, b - a - 1);
  r.version = line.substr(b + 1);
  if (r.version != "HTTP/1.1" && r.version != "HTTP/1.0") return std::nullopt;
  if (r.target.find(' ') != std::string::npos) return std::nullopt;
  r.path = r.target.substr(0, r.target.find('?'));
  for (size_t at = line_end + 2; at < head.size();) {
    const size_t end = head.find("\r\n", at);
    if (end == std::string::npos) return std::nullopt;
    if (end == at) break;  // the blank line
    const std::string field = head.substr(at, end - at);
    const size_t colon = field.find(':');
    if (colon == std::string::npos || colon == 0 || field[0] == ' ' || field[0] == '\t' ||
        field.find_first_of(" \t") < colon)
      return std::nullopt;
    std::string value = field.substr(colon + 1);
    const size_t first = value.find_first_not_of(" \t");
    value = first == std::string::npos ? "" : value.substr(first);
    value.erase(value.find_last_not_of(" \t") + 1);
    r.headers.emplace(field.substr(0, colon), value);
    at = end + 2;
  }
  return r;
}

int64_t declared_body_bytes(const httplib::Request& req, int64_t max_body_bytes) {
  if (req.has_header("Transfer-Encoding")) return max_body_bytes;
  if (!req.has_header("Content-Length")) return 0;
  const std::string v = trimmed_lower(req.get_header_value("Content-Length"));
  return is_length(v) ? std::stoll(v) : 0;
}

}  // namespace lvx::serve
