// safetensors reading (memory-mapped, validated) and writing.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "util/mmap_file.h"

namespace dsx {

enum class DType { BF16, F16, F32, F64, I8, U8, I16, I32, I64, BOOL, F8_E4M3, F8_E8M0 };

const char* dtype_name(DType t);
size_t dtype_size(DType t);
bool dtype_from_name(const std::string& s, DType* out);

// A view of one tensor inside a mapped file. Never owns memory.
struct TensorView {
  std::string name;
  std::string file;  // file it lives in (for error messages)
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;

  int64_t numel() const;
  int64_t dim(int i) const { return shape.at(static_cast<size_t>(i)); }
  std::string shape_str() const;
  template <typename T>
  const T* as() const { return reinterpret_cast<const T*>(data); }
};

std::string shape_to_string(const std::vector<int64_t>& s);

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;
  const TensorView& get(const std::string& name) const;  // throws naming the file
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return file_.path(); }

 private:
  MappedFile file_;
  std::map<std::string, TensorView> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writer: collects tensors then writes one file atomically.
class SafetensorsWriter {
 public:
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data, size_t nbytes);
  template <typename T>
  void add(const std::string& name, DType dtype, std::vector<int64_t> shape, const std::vector<T>& v) {
    add(name, dtype, std::move(shape), v.data(), v.size() * sizeof(T));
  }
  void set_metadata(const std::string& k, const std::string& v) { metadata_[k] = v; }
  void write(const std::string& path) const;

 private:
  struct Entry {
    DType dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
  };
  std::map<std::string, Entry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace dsx
