// Helpers shared by the tests.
#pragma once
#include <cstdlib>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace dsx_test {

// A fresh, empty directory under the build tree (or /tmp).
inline std::string temp_dir(const std::string& name) {
  const char* b = std::getenv("DSX_BUILD_DIR");
  std::filesystem::path base = b ? std::filesystem::path(b) / "test_tmp" : std::filesystem::temp_directory_path() / "dsx_test_tmp";
  auto p = base / (name + "-" + std::to_string(::getpid()));  // ctest runs tests in parallel processes
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

// Root of ../shared/golden (DSX_GOLDEN_DIR overrides). Empty if absent.
inline std::string golden_dir() {
  if (const char* g = std::getenv("DSX_GOLDEN_DIR")) return g;
  std::filesystem::path p = std::filesystem::path(DSX_SOURCE_DIR) / ".." / "shared" / "golden";
  if (std::filesystem::exists(p)) return std::filesystem::canonical(p).string();
  return "";
}

// The source tree (the model assets, train/): DSX_SOURCE_DIR overrides the configured one
// (a test binary carried to another machine runs in its copy of the tree).
inline std::string source_dir() {
  if (const char* s = std::getenv("DSX_SOURCE_DIR")) return s;
  return DSX_SOURCE_DIR;
}

}  // namespace dsx_test

#define DSX_REQUIRE_GOLDEN(dir)                                                            \
  const std::string dir = dsx_test::golden_dir();                                          \
  if (dir.empty()) GTEST_SKIP() << "golden data not found (set DSX_GOLDEN_DIR or ../shared/golden)"
