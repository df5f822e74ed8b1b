#include "util/snapshot_io.h"

#include <xxhash.h>

#include <cstring>

#include "util/error.h"

namespace dsx {

namespace {
constexpr char kMagic[8] = {'D', 'S', 'X', 'S', 'N', 'A', 'P', '\n'};
constexpr char kOldMagic[8] = {'D', 'S', 'X', 'K', 'V', 'S', '0', '1'};
constexpr char kEnd[8] = {'D', 'S', 'X', 'E', 'N', 'D', '\0', '\0'};
constexpr uint32_t kMaxHeader = 1u << 20;
}  // namespace

struct SnapshotWriter::Hash {
  XXH3_state_t* s = XXH3_createState();
  Hash() { XXH3_64bits_reset(s); }
  ~Hash() { XXH3_freeState(s); }
};
struct SnapshotReader::Hash {
  XXH3_state_t* s = XXH3_createState();
  Hash() { XXH3_64bits_reset(s); }
  ~Hash() { XXH3_freeState(s); }
};

SnapshotWriter::SnapshotWriter(ByteSink& sink, const std::string& header_json) : sink_(sink), h_(new Hash) {
  DSX_CHECK(header_json.size() <= kMaxHeader, "snapshot header too large");
  put(kMagic, 8);
  const uint32_t v = kSnapshotVersion, n = static_cast<uint32_t>(header_json.size());
  put(&v, 4);
  put(&n, 4);
  put(header_json.data(), header_json.size());
}

SnapshotWriter::~SnapshotWriter() = default;

void SnapshotWriter::put(const void* p, size_t n) {
  XXH3_64bits_update(h_->s, p, n);
  sink_.write(p, n);
  total_ += n;
}

void SnapshotWriter::begin(uint32_t tag, uint32_t layer, uint64_t bytes) {
  DSX_CHECK(left_ == 0 && !finished_, "snapshot writer: a section is still incomplete");
  uint8_t h[16];
  std::memcpy(h, &tag, 4);
  std::memcpy(h + 4, &layer, 4);
  std::memcpy(h + 8, &bytes, 8);
  put(h, 16);
  left_ = bytes;
}

void SnapshotWriter::write(const void* p, size_t n) {
  DSX_CHECK(n <= left_, "snapshot writer: more bytes than the section declared");
  put(p, n);
  left_ -= n;
}

void SnapshotWriter::finish() {
  DSX_CHECK(left_ == 0 && !finished_, "snapshot writer: a section is still incomplete");
  const uint64_t sum = XXH3_64bits_digest(h_->s);
  sink_.write(kEnd, 8);
  sink_.write(&sum, 8);
  total_ += 16;
  finished_ = true;
}

SnapshotReader::SnapshotReader(ByteSource& src, const std::string& what) : src_(src), what_(what), h_(new Hash) {
  char m[8];
  const size_t got = src_.read(m, 8);
  if (got == 8 && std::memcmp(m, kOldMagic, 8) == 0)
    fail(what_, " is in the old dsx snapshot format (DSXKVS01, version 1); this build reads version ",
         kSnapshotVersion, " only: save it again");
  if (got < 8 || std::memcmp(m, kMagic, 8) != 0) fail(what_, " is not a dsx snapshot (bad magic)");
  XXH3_64bits_update(h_->s, m, 8);
  offset_ = 8;
  uint32_t v = 0, n = 0;
  get(&v, 4, "version");
  if (v != kSnapshotVersion)
    fail(what_, " has format version ", v, "; this build reads version ", kSnapshotVersion, " only");
  get(&n, 4, "header length");
  if (n > kMaxHeader) corrupt(cat("header length ", n));
  header_.resize(n);
  get(header_.data(), n, "header");
}

SnapshotReader::~SnapshotReader() = default;

void SnapshotReader::corrupt(const std::string& why) const {
  fail(what_, " is corrupt (", why, ", at byte ", offset_, ")");
}

void SnapshotReader::get(void* p, size_t n, const char* what) {
  const size_t got = src_.read(p, n);
  if (got != n) fail(what_, " is truncated (", what, ", at byte ", offset_ + got, ")");
  XXH3_64bits_update(h_->s, p, n);
  offset_ += n;
}

void SnapshotReader::begin(uint32_t tag, uint32_t layer, uint64_t bytes, const char* name) {
  if (left_ != 0) corrupt("section " + section_ + " not read to its end");
  section_ = cat(name, layer != UINT32_MAX ? cat(" of layer ", layer) : "");
  uint8_t h[16];
  get(h, 16, section_.c_str());
  uint32_t t, l;
  uint64_t b;
  std::memcpy(&t, h, 4);
  std::memcpy(&l, h + 4, 4);
  std::memcpy(&b, h + 8, 8);
  if (t != tag || l != layer || b != bytes)
    corrupt(cat("expected section ", section_, " of ", bytes, " bytes, found tag ", t, " layer ", l, " of ", b,
                " bytes"));
  left_ = bytes;
}

void SnapshotReader::read(void* p, size_t n) {
  if (n > left_) corrupt("read past the end of section " + section_);
  get(p, n, section_.c_str());
  left_ -= n;
}

void SnapshotReader::finish() {
  if (left_ != 0) corrupt("section " + section_ + " not read to its end");
  const uint64_t sum = XXH3_64bits_digest(h_->s);
  uint8_t t[16];
  const size_t got = src_.read(t, 16);
  if (got != 16) fail(what_, " is truncated (trailer, at byte ", offset_ + got, ")");
  if (std::memcmp(t, kEnd, 8) != 0) corrupt("no trailer after the last section");
  uint64_t stored;
  std::memcpy(&stored, t + 8, 8);
  if (stored != sum) fail(what_, " is corrupt (checksum mismatch)");
  uint8_t extra;
  if (src_.read(&extra, 1) != 0) fail(what_, " has trailing bytes after its trailer");
}

}  // namespace dsx
