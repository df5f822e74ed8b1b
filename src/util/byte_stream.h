// Streams of bytes for snapshots and caches: a sink that is written in pieces and a
// source that is read in pieces, so that nothing needs the whole payload in memory.
// Implementations: a file descriptor, a growing vector / a byte span, callbacks.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace dsx {

class ByteSink {
 public:
  virtual ~ByteSink() = default;
  // Writes all n bytes or throws dsx::Error.
  virtual void write(const void* p, size_t n) = 0;
};

class ByteSource {
 public:
  virtual ~ByteSource() = default;
  // Reads up to n bytes; returns fewer than n only at the end of the data. Throws
  // dsx::Error on an I/O error.
  virtual size_t read(void* p, size_t n) = 0;
};

// A POSIX file descriptor (not closed by these classes); `what` names it in errors.
class FdSink : public ByteSink {
 public:
  FdSink(int fd, const char* what = "file") : fd_(fd), what_(what) {}
  void write(const void* p, size_t n) override;
  uint64_t written() const { return written_; }

 private:
  int fd_;
  const char* what_;
  uint64_t written_ = 0;
};

class FdSource : public ByteSource {
 public:
  FdSource(int fd, const char* what = "file") : fd_(fd), what_(what) {}
  size_t read(void* p, size_t n) override;

 private:
  int fd_;
  const char* what_;
};

class VectorSink : public ByteSink {
 public:
  void write(const void* p, size_t n) override {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes.insert(bytes.end(), b, b + n);
  }
  std::vector<uint8_t> bytes;
};

class SpanSource : public ByteSource {
 public:
  SpanSource(const void* p, size_t n) : p_(static_cast<const uint8_t*>(p)), n_(n) {}
  explicit SpanSource(const std::vector<uint8_t>& v) : SpanSource(v.data(), v.size()) {}
  size_t read(void* p, size_t n) override;

 private:
  const uint8_t* p_;
  size_t n_, off_ = 0;
};

class CallbackSink : public ByteSink {
 public:
  explicit CallbackSink(std::function<void(const void*, size_t)> f) : f_(std::move(f)) {}
  void write(const void* p, size_t n) override { f_(p, n); }

 private:
  std::function<void(const void*, size_t)> f_;
};

class CallbackSource : public ByteSource {
 public:
  explicit CallbackSource(std::function<size_t(void*, size_t)> f) : f_(std::move(f)) {}
  size_t read(void* p, size_t n) override;

 private:
  std::function<size_t(void*, size_t)> f_;
};

}  // namespace dsx
