#include "util/byte_stream.h"

#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>

#include "util/error.h"

namespace dsx {

void FdSink::write(const void* p, size_t n) {
  const auto* b = static_cast<const uint8_t*>(p);
  while (n > 0) {
    const ssize_t w = ::write(fd_, b, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(what_, ": write failed: ", std::strerror(errno));
    }
    b += w;
    n -= static_cast<size_t>(w);
    written_ += static_cast<uint64_t>(w);
  }
}

size_t FdSource::read(void* p, size_t n) {
  auto* b = static_cast<uint8_t*>(p);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::read(fd_, b + got, n - got);
    if (r < 0) {
      if (errno == EINTR) continue;
      fail(what_, ": read failed: ", std::strerror(errno));
    }
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return got;
}

size_t SpanSource::read(void* p, size_t n) {
  const size_t k = std::min(n, n_ - off_);
  if (k) std::memcpy(p, p_ + off_, k);
  off_ += k;
  return k;
}

size_t CallbackSource::read(void* p, size_t n) {
  auto* b = static_cast<uint8_t*>(p);
  size_t got = 0;
  while (got < n) {
    const size_t r = f_(b + got, n - got);
    if (r == 0) break;
    got += r;
  }
  return got;
}

}  // namespace dsx
