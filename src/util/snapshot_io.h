// The container of a dsx session snapshot (and of the disk cache's entries): a magic
// and version, a JSON header (model identity, geometry, position: whatever the writer
// puts there), a sequence of sections (tag, layer, byte count, payload) and a trailer
// with an XXH3-64 checksum of everything before it. Written and read in pieces through
// a ByteSink / ByteSource, so that no whole snapshot is ever held in memory.
//
//   "DSXSNAP\n"  u32 version  u32 header bytes  header (JSON text)
//   section*:    u32 tag  u32 layer  u64 bytes  payload
//   "DSXEND\0\0" u64 xxh3-64(all bytes before the trailer)
//
// All integers little-endian. A reader refuses, with an error that names the problem: a
// file that is not a snapshot, another version (the previous format "DSXKVS01" by name),
// a section other than the one expected, a truncated stream, a checksum mismatch and
// bytes after the trailer.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "util/byte_stream.h"

namespace dsx {

constexpr uint32_t kSnapshotVersion = 2;

class SnapshotWriter {
 public:
  SnapshotWriter(ByteSink& sink, const std::string& header_json);
  ~SnapshotWriter();
  // Starts a section of `bytes` payload bytes, written by write() calls that add up to it.
  void begin(uint32_t tag, uint32_t layer, uint64_t bytes);
  void write(const void* p, size_t n);
  void finish();  // the trailer (after the last section is complete)
  uint64_t bytes_written() const { return total_; }

 private:
  void put(const void* p, size_t n);
  ByteSink& sink_;
  struct Hash;
  std::unique_ptr<Hash> h_;
  uint64_t total_ = 0, left_ = 0;
  bool finished_ = false;
};

class SnapshotReader {
 public:
  // Reads and checks the magic, version and header. `what` names the source in errors.
  SnapshotReader(ByteSource& src, const std::string& what = "session snapshot");
  ~SnapshotReader();
  const std::string& header() const { return header_; }
  // Reads a section header and checks that it is (tag, layer, bytes).
  void begin(uint32_t tag, uint32_t layer, uint64_t bytes, const char* name);
  void read(void* p, size_t n);
  // Reads the trailer, checks the checksum and that nothing follows.
  void finish();
  [[noreturn]] void corrupt(const std::string& why) const;

 private:
  void get(void* p, size_t n, const char* what);
  ByteSource& src_;
  std::string what_;
  struct Hash;
  std::unique_ptr<Hash> h_;
  std::string header_;
  uint64_t offset_ = 0, left_ = 0;
  std::string section_;
};

}  // namespace dsx
