#include "util/safetensors.h"

#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "util/error.h"

namespace dsx {

namespace {
struct DTypeInfo {
  DType t;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::BF16, "BF16", 2}, {DType::F16, "F16", 2},         {DType::F32, "F32", 4},
    {DType::F64, "F64", 8},   {DType::I8, "I8", 1},           {DType::U8, "U8", 1},
    {DType::I16, "I16", 2},   {DType::I32, "I32", 4},         {DType::I64, "I64", 8},
    {DType::BOOL, "BOOL", 1}, {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E8M0, "F8_E8M0", 1},
};
constexpr uint64_t kMaxHeader = 512ull << 20;  // 512 MiB: far above any real header
}  // namespace

const char* dtype_name(DType t) {
  for (const auto& d : kDTypes)
    if (d.t == t) return d.name;
  return "?";
}
size_t dtype_size(DType t) {
  for (const auto& d : kDTypes)
    if (d.t == t) return d.size;
  return 0;
}
bool dtype_from_name(const std::string& s, DType* out) {
  for (const auto& d : kDTypes)
    if (s == d.name) {
      *out = d.t;
      return true;
    }
  return false;
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string shape_to_string(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) r += ", ";
    r += std::to_string(s[i]);
  }
  return r + "]";
}
std::string TensorView::shape_str() const { return shape_to_string(shape); }

SafetensorsFile::SafetensorsFile(const std::string& path) : file_(path) {
  const size_t fsize = file_.size();
  if (fsize < 8) fail(path, ": truncated safetensors file (", fsize, " bytes, no header length)");
  uint64_t hlen = 0;
  std::memcpy(&hlen, file_.data(), 8);
  if (hlen > kMaxHeader || hlen > fsize - 8)
    fail(path, ": truncated or corrupt safetensors header (header length ", hlen, ", file size ", fsize, ")");
  const char* hp = reinterpret_cast<const char*>(file_.data() + 8);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(hp, hp + hlen);
  } catch (const std::exception& e) {
    fail(path, ": safetensors header is not valid JSON: ", e.what());
  }
  if (!j.is_object()) fail(path, ": safetensors header is not a JSON object");
  const uint8_t* base = file_.data() + 8 + hlen;
  const size_t data_size = fsize - 8 - hlen;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    if (name == "__metadata__") {
      if (it->is_object())
        for (auto m = it->begin(); m != it->end(); ++m)
          if (m->is_string()) metadata_[m.key()] = m->get<std::string>();
      continue;
    }
    const auto& e = *it;
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      fail(path, ": tensor '", name, "': header entry lacks dtype/shape/data_offsets");
    TensorView tv;
    tv.name = name;
    tv.file = path;
    if (!e["dtype"].is_string() || !dtype_from_name(e["dtype"].get<std::string>(), &tv.dtype))
      fail(path, ": tensor '", name, "': unsupported dtype ", e["dtype"].dump());
    if (!e["shape"].is_array()) fail(path, ": tensor '", name, "': shape is not an array");
    int64_t numel = 1;
    for (const auto& d : e["shape"]) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) fail(path, ": tensor '", name, "': bad shape entry");
      int64_t v = d.get<int64_t>();
      if (v > 0 && numel > std::numeric_limits<int64_t>::max() / v) fail(path, ": tensor '", name, "': shape overflows");
      numel *= v;
      tv.shape.push_back(v);
    }
    const auto& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(path, ": tensor '", name, "': bad data_offsets");
    uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    if (b > en || en > data_size)
      fail(path, ": tensor '", name, "': data [", b, ", ", en, ") lies outside the file's ", data_size,
           " data bytes (truncated file?)");
    tv.nbytes = static_cast<size_t>(en - b);
    if (static_cast<uint64_t>(numel) * dtype_size(tv.dtype) != tv.nbytes)
      fail(path, ": tensor '", name, "': ", tv.nbytes, " bytes do not match shape ", tv.shape_str(), " of ",
           dtype_name(tv.dtype));
    tv.data = base + b;
    tensors_.emplace(name, std::move(tv));
  }
}

const TensorView* SafetensorsFile::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const TensorView& SafetensorsFile::get(const std::string& name) const {
  const TensorView* t = find(name);
  if (!t) fail(path(), ": tensor '", name, "' not found");
  return *t;
}

void SafetensorsWriter::add(const std::string& name, DType dtype, std::vector<int64_t> shape, const void* data,
                            size_t nbytes) {
  int64_t numel = 1;
  for (auto d : shape) numel *= d;
  DSX_CHECK(static_cast<size_t>(numel) * dtype_size(dtype) == nbytes, "safetensors writer: tensor '", name,
            "' has ", nbytes, " bytes for shape ", shape_to_string(shape));
  Entry e{dtype, std::move(shape), {}};
  e.bytes.assign(static_cast<const uint8_t*>(data), static_cast<const uint8_t*>(data) + nbytes);
  entries_[name] = std::move(e);
}

void SafetensorsWriter::write(const std::string& path) const {
  nlohmann::json h = nlohmann::json::object();
  uint64_t off = 0;
  for (const auto& [name, e] : entries_) {
    h[name] = {{"dtype", dtype_name(e.dtype)}, {"shape", e.shape}, {"data_offsets", {off, off + e.bytes.size()}}};
    off += e.bytes.size();
  }
  if (!metadata_.empty()) h["__metadata__"] = metadata_;
  std::string hs = h.dump();
  while ((hs.size() + 8) % 8 != 0) hs.push_back(' ');
  std::vector<uint8_t> out(8 + hs.size() + off);
  uint64_t hl = hs.size();
  std::memcpy(out.data(), &hl, 8);
  std::memcpy(out.data() + 8, hs.data(), hs.size());
  size_t p = 8 + hs.size();
  for (const auto& [name, e] : entries_) {
    if (!e.bytes.empty()) std::memcpy(out.data() + p, e.bytes.data(), e.bytes.size());
    p += e.bytes.size();
  }
  write_file_atomic(path, out.data(), out.size());
}

}  // namespace dsx
