// A file read ahead on a thread: the reads of a restore at the disk's speed. The thread
// reads consecutive chunks into a few aligned buffers while the consumer (hashing,
// copying to pinned memory, uploading to the device) works on the ones that arrived, so
// the disk never waits for the consumer and the consumer only for the disk. With a
// descriptor opened O_DIRECT the chunks bypass the page cache (one copy less, and large
// requests straight to the device); a file system that refuses O_DIRECT reads is read
// through the page cache instead (the descriptor's O_DIRECT is cleared).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "util/byte_stream.h"

namespace dsx {

class PrefetchReader : public ByteSource {
 public:
  // Reads fd (not owned, not closed; positioned anywhere) from offset 0 to `size` bytes
  // in chunks of `chunk` bytes (a multiple of 4096), `depth` chunks ahead at most. `what`
  // names the file in errors.
  PrefetchReader(int fd, uint64_t size, std::string what, size_t chunk = size_t{8} << 20, int depth = 4);
  ~PrefetchReader() override;
  PrefetchReader(const PrefetchReader&) = delete;
  PrefetchReader& operator=(const PrefetchReader&) = delete;

  // Fewer than n bytes only at the end of the file; throws dsx::Error on a read error
  // (or when the file ends before `size`).
  size_t read(void* p, size_t n) override;
  // Whether the chunks were read bypassing the page cache.
  bool direct() const { return direct_; }

 private:
  struct Slot {
    uint8_t* data = nullptr;
    size_t len = 0;
    bool full = false;
  };
  void run();
  size_t pread_full(uint8_t* p, size_t n, uint64_t off);
  void drop_direct();

  int fd_;
  uint64_t size_;
  std::string what_;
  size_t chunk_;
  std::vector<Slot> slots_;
  std::atomic<bool> direct_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::string error_;
  uint64_t chunks_ = 0;      // chunks in the file
  uint64_t next_read_ = 0;   // the thread's next chunk
  uint64_t next_use_ = 0;    // the consumer's current chunk
  size_t pos_ = 0;           // within it
  std::thread th_;
};

}  // namespace dsx
