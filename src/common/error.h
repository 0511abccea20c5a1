// Errors that say what is wrong: every check names the argument, the expected and the actual
// value. lvx::Error is what user-facing code throws; the CLI prints what() and exits non-zero.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace lvx {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
}  // namespace detail

// str("a=", 1, ", b=", 2.5): the message builder used by LVX_CHECK and friends.
template <typename... Args>
std::string str(Args&&... args) {
  return detail::concat(std::forward<Args>(args)...);
}

}  // namespace lvx

// LVX_CHECK(cond, "message parts", ...): throws lvx::Error with the message when cond is false.
// The condition must be a real expression: a string literal as cond is rejected at compile time.
#define LVX_CHECK(cond, ...)                                                            \
  do {                                                                                  \
    static_assert(!std::is_convertible_v<decltype(cond), const char*>,                  \
                  "LVX_CHECK condition must not be a string");                          \
    if (!(cond)) throw ::lvx::Error(::lvx::str(__VA_ARGS__));                            \
  } while (0)

#define LVX_FAIL(...) throw ::lvx::Error(::lvx::str(__VA_ARGS__))
