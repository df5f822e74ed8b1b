// dsx: error type used everywhere. Every failure that can come from user input
// (files, JSON, requests) is reported as a dsx::Error whose message names the
// offending file / tensor / field.
#pragma once
#include <stdexcept>
#include <string>
#include <sstream>

namespace dsx {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

namespace detail {
inline void format_into(std::ostringstream&) {}
template <typename T, typename... Rest>
void format_into(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  format_into(os, rest...);
}
}  // namespace detail

// Concatenate arguments with operator<< into a string.
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  detail::format_into(os, args...);
  return os.str();
}

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(cat(args...));
}

#define DSX_CHECK(cond, ...)                 \
  do {                                       \
    if (!(cond)) ::dsx::fail(__VA_ARGS__);   \
  } while (0)

}  // namespace dsx
