// Read-only memory mapping of a whole file.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace dsx {

class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void release();
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Whole file into a string (small files: JSON).
std::string read_text_file(const std::string& path);
bool file_exists(const std::string& path);
void write_file_atomic(const std::string& path, const void* data, size_t n);

}  // namespace dsx
