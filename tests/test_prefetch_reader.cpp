// PrefetchReader (the disk cache's restore reads): every byte of a file in order, whatever
// the file's size against its chunks and whatever the reads' sizes, with O_DIRECT and
// without; a file shorter than announced is an error naming it, never silent data.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cache/prefetch_reader.h"
#include "test_util.h"
#include "util/error.h"

using namespace dsx;

namespace {

std::string write_file(const std::string& dir, const std::vector<uint8_t>& b) {
  const std::string p = dir + "/f" + std::to_string(b.size());
  FILE* f = std::fopen(p.c_str(), "wb");
  EXPECT_TRUE(f);
  if (!b.empty()) EXPECT_EQ(std::fwrite(b.data(), 1, b.size(), f), b.size());
  std::fclose(f);
  return p;
}

std::vector<uint8_t> read_all(int fd, uint64_t size, std::mt19937_64& rng, bool* direct) {
  PrefetchReader r(fd, size, "test file", 16384, 3);
  std::vector<uint8_t> out;
  std::vector<uint8_t> buf(70000);
  for (;;) {
    const size_t n = 1 + rng() % (rng() % 2 ? 100 : buf.size());
    const size_t got = r.read(buf.data(), n);
    out.insert(out.end(), buf.begin(), buf.begin() + static_cast<std::ptrdiff_t>(got));
    if (got < n) break;
  }
  if (direct) *direct = r.direct();
  return out;
}

}  // namespace

TEST(PrefetchReader, EveryByteInOrder) {
  const std::string dir = dsx_test::temp_dir("prefetch");
  std::mt19937_64 rng(7);
  for (size_t size : {size_t{0}, size_t{1}, size_t{4095}, size_t{4096}, size_t{16383}, size_t{16384}, size_t{16385},
                      size_t{3 * 16384}, size_t{200000}}) {
    std::vector<uint8_t> b(size);
    for (auto& x : b) x = static_cast<uint8_t>(rng());
    const std::string p = write_file(dir, b);
    for (int direct = 0; direct < 2; ++direct) {
      int fd = ::open(p.c_str(), O_RDONLY | (direct ? O_DIRECT : 0));
      if (fd < 0 && direct) fd = ::open(p.c_str(), O_RDONLY);
      ASSERT_GE(fd, 0);
      bool used_direct = false;
      EXPECT_EQ(read_all(fd, size, rng, &used_direct), b) << size << " bytes, O_DIRECT " << direct;
      if (!direct) EXPECT_FALSE(used_direct);
      ::close(fd);
    }
  }
}

TEST(PrefetchReader, ShorterFileIsAnError) {
  const std::string dir = dsx_test::temp_dir("prefetch_short");
  std::vector<uint8_t> b(50000, 7);
  const std::string p = write_file(dir, b);
  const int fd = ::open(p.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  std::mt19937_64 rng(1);
  try {
    read_all(fd, 60000, rng, nullptr);
    ADD_FAILURE() << "a file shorter than announced was read without an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("test file: truncated"), std::string::npos) << e.what();
  }
  ::close(fd);
}

TEST(PrefetchReader, StopsEarlyWithoutReadingAll) {
  const std::string dir = dsx_test::temp_dir("prefetch_early");
  std::vector<uint8_t> b(1 << 20, 3);
  const std::string p = write_file(dir, b);
  const int fd = ::open(p.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  {
    PrefetchReader r(fd, b.size(), "test file", 16384, 2);
    uint8_t x[10];
    EXPECT_EQ(r.read(x, 10), 10u);
    EXPECT_EQ(x[9], 3);
  }  // the destructor stops the reading thread while it waits for a free buffer
  ::close(fd);
}
