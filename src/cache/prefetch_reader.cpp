#include "cache/prefetch_reader.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "util/error.h"

namespace dsx {

PrefetchReader::PrefetchReader(int fd, uint64_t size, std::string what, size_t chunk, int depth)
    : fd_(fd), size_(size), what_(std::move(what)), chunk_(chunk) {
  DSX_CHECK(chunk_ >= 4096 && chunk_ % 4096 == 0, "PrefetchReader: chunk must be a multiple of 4096");
  DSX_CHECK(depth >= 2, "PrefetchReader: depth must be at least 2");
  const int fl = ::fcntl(fd_, F_GETFL);
  direct_ = fl >= 0 && (fl & O_DIRECT) != 0;
  chunks_ = (size_ + chunk_ - 1) / chunk_;
  slots_.resize(static_cast<size_t>(std::min<uint64_t>(static_cast<uint64_t>(depth), std::max<uint64_t>(chunks_, 1))));
  for (auto& s : slots_) {
    s.data = static_cast<uint8_t*>(std::aligned_alloc(4096, chunk_));
    if (!s.data) {
      for (auto& t : slots_) std::free(t.data);
      fail(what_, ": cannot allocate ", slots_.size(), " read buffers of ", chunk_, " bytes");
    }
  }
  th_ = std::thread([this] { run(); });
}

PrefetchReader::~PrefetchReader() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  th_.join();
  for (auto& s : slots_) std::free(s.data);
}

// The rest of the file through the page cache.
void PrefetchReader::drop_direct() {
  ::fcntl(fd_, F_SETFL, ::fcntl(fd_, F_GETFL) & ~O_DIRECT);
  direct_ = false;
}

// n bytes at off (n a multiple of 4096 but for the file's last chunk, read whole: the
// request is rounded up to the alignment O_DIRECT wants and the file's end stops it).
size_t PrefetchReader::pread_full(uint8_t* p, size_t n, uint64_t off) {
  const size_t want = (n + 4095) / 4096 * 4096;
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd_, p + got, want - got, static_cast<off_t>(off + got));
    if (r > 0) {
      got += static_cast<size_t>(r);
      if (direct_ && got % 4096 != 0 && got < n) drop_direct();  // a short unaligned read
      continue;
    }
    if (r == 0) break;
    if (errno == EINTR) continue;
    if (errno == EINVAL && direct_) {  // the file system refuses O_DIRECT reads
      drop_direct();
      continue;
    }
    fail(what_, ": read failed: ", std::strerror(errno));
  }
  return std::min(got, n);
}

void PrefetchReader::run() {
  for (uint64_t c = 0; c < chunks_; ++c) {
    Slot* s = nullptr;
    {
      std::unique_lock<std::mutex> l(mu_);
      Slot& t = slots_[static_cast<size_t>(c % slots_.size())];
      cv_.wait(l, [&] { return stop_ || !t.full; });
      if (stop_) return;
      s = &t;
    }
    const uint64_t off = c * chunk_;
    const size_t n = static_cast<size_t>(std::min<uint64_t>(chunk_, size_ - off));
    size_t got = 0;
    std::string err;
    try {
      got = pread_full(s->data, n, off);
      if (got < n) err = cat(what_, ": truncated (the file ended at ", off + got, " of ", size_, " bytes)");
    } catch (const std::exception& e) {
      err = e.what();
    }
    {
      std::lock_guard<std::mutex> l(mu_);
      s->len = got;
      s->full = true;
      next_read_ = c + 1;
      if (!err.empty()) error_ = err;
    }
    cv_.notify_all();
    if (!err.empty()) return;
  }
}

size_t PrefetchReader::read(void* p, size_t n) {
  auto* out = static_cast<uint8_t*>(p);
  size_t got = 0;
  while (got < n && next_use_ < chunks_) {
    Slot& s = slots_[static_cast<size_t>(next_use_ % slots_.size())];
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return s.full || (!error_.empty() && next_read_ <= next_use_); });
      if (!s.full) fail(error_);
    }
    const size_t k = std::min(n - got, s.len - pos_);
    std::memcpy(out + got, s.data + pos_, k);
    got += k;
    pos_ += k;
    if (pos_ == s.len) {
      if (s.len < std::min<uint64_t>(chunk_, size_ - next_use_ * chunk_)) {
        std::lock_guard<std::mutex> l(mu_);
        fail(error_.empty() ? cat(what_, ": truncated") : error_);
      }
      {
        std::lock_guard<std::mutex> l(mu_);
        s.full = false;
      }
      cv_.notify_all();
      pos_ = 0;
      ++next_use_;
    }
  }
  return got;
}

}  // namespace dsx
