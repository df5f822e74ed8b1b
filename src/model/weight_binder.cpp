#include "model/weight_binder.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "model/weights.h"
#include "util/error.h"
#include "util/numerics.h"

namespace dsx {

WeightBinder::WeightBinder(const ModelConfig& c, const ModelFiles& f, bool skip_vision)
    : c_(c), f_(f), skip_vision_(skip_vision) {}

const TensorView& WeightBinder::tensor(const std::string& name, const std::vector<int64_t>& shape,
                                       std::initializer_list<DType> dtypes) {
  const TensorView* t = f_.find(name);
  std::string want;
  for (DType d : dtypes) want += std::string(want.empty() ? "" : "/") + dtype_name(d);
  if (!t) fail(f_.dir(), ": tensor '", name, "' is missing (config expects ", want, " ", shape_to_string(shape), ")");
  if (std::find(dtypes.begin(), dtypes.end(), t->dtype) == dtypes.end())
    fail(t->file, ": tensor '", name, "' has dtype ", dtype_name(t->dtype), ", expected ", want);
  if (t->shape != shape)
    fail(t->file, ": tensor '", name, "' has shape ", t->shape_str(), ", config expects ", shape_to_string(shape));
  used_.insert(name);
  return *t;
}

bool WeightBinder::has(const std::string& name) const { return f_.find(name) != nullptr; }

std::vector<float> WeightBinder::f32(const std::string& name, std::vector<int64_t> shape) {
  return widen(tensor(name, shape, {DType::F32, DType::BF16}));
}

std::vector<float> WeightBinder::vec(const std::string& name, int64_t n) {
  return widen(tensor(name, {n}, {DType::BF16, DType::F32}));
}

QMatrix WeightBinder::dense(const std::string& name, int64_t n, int64_t k, bool f32_only) {
  const TensorView& t = f32_only ? tensor(name, {n, k}, {DType::F32}) : tensor(name, {n, k}, {DType::BF16, DType::F32});
  QMatrix m;
  m.fmt = t.dtype == DType::BF16 ? WFormat::BF16 : WFormat::F32;
  m.rows = n;
  m.cols = k;
  m.data = t.data;
  m.name = name;
  return m;
}

QMatrix WeightBinder::fp8(const std::string& base, int64_t n, int64_t k) {
  const int64_t b = c_.quant_block;
  const TensorView& w = tensor(base + ".weight", {n, k}, {DType::F8_E4M3});
  const TensorView& s = tensor(base + ".scale", {(n + b - 1) / b, (k + b - 1) / b}, {DType::F8_E8M0});
  QMatrix m;
  m.fmt = WFormat::FP8_BLOCK;
  m.rows = n;
  m.cols = k;
  m.block = static_cast<int>(b);
  m.data = w.data;
  m.scale = s.data;
  m.name = base;
  return m;
}

QMatrix WeightBinder::mxfp4(const std::string& base, int64_t n, int64_t k) {
  if (k % 32) fail(f_.dir(), ": ", base, ": input width ", k, " is not a multiple of 32 (MXFP4)");
  const TensorView& w = tensor(base + ".weight", {n, k / 2}, {DType::I8, DType::U8});
  const TensorView& s = tensor(base + ".scale", {n, k / 32}, {DType::F8_E8M0});
  QMatrix m;
  m.fmt = WFormat::MXFP4;
  m.rows = n;
  m.cols = k;
  m.block = 32;
  m.data = w.data;
  m.scale = s.data;
  m.name = base;
  return m;
}

QMatrix WeightBinder::matrix(const TensorSpec& t) {
  switch (t.storage) {
    case Storage::BF16Matrix: return dense(t.name, t.rows(), t.cols());
    case Storage::F32Matrix: {
      QMatrix m = dense(t.name, t.rows(), t.cols());
      if (m.fmt != WFormat::F32) fail(f_.dir(), ": tensor '", t.name, "' must be F32");
      return m;
    }
    case Storage::FP8: return fp8(t.name, t.rows(), t.cols());
    case Storage::MXFP4: return mxfp4(t.name, t.rows(), t.cols());
    default: fail(f_.dir(), ": tensor '", t.name, "' (", storage_name(t.storage), ") is not a matrix");
  }
}

std::vector<float> WeightBinder::values(const TensorSpec& t) {
  if (!is_vector(t.storage)) fail(f_.dir(), ": tensor '", t.name, "' (", storage_name(t.storage), ") is not a vector");
  if (t.storage == Storage::BF16Vector && t.shape.size() == 1) return vec(t.name, t.rows());
  return f32(t.name, t.shape);
}

void WeightBinder::check_unused() const {
  for (const auto& name : f_.names()) {
    if (used_.count(name) || ignorable(name)) continue;
    fail(f_.find(name)->file, ": unexpected tensor '", name, "' (not part of a ", c_.model_type,
         " model with this config)");
  }
}

bool WeightBinder::ignorable(const std::string& n) const {
  auto starts = [&](const char* p) { return n.rfind(p, 0) == 0; };
  if (skip_vision_ &&
      (starts("vision.") || starts("aligner.") || n == "image_start" || n == "image_end" || n == "image_newline"))
    return true;
  if (!starts("mtp.")) return false;
  // draft stages declared by the config (DSpark / MTP) are not used by the backbone
  const size_t dot = n.find('.', 4);
  if (dot == std::string::npos) return false;
  const int stage = std::atoi(n.substr(4, dot - 4).c_str());
  return stage >= 0 && stage < c_.n_nextn_layers;
}

std::vector<float> WeightBinder::widen(const TensorView& t) {
  std::vector<float> v(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::F32) {
    std::memcpy(v.data(), t.data, v.size() * 4);
  } else {
    const auto* p = t.as<uint16_t>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_f32(p[i]);
  }
  return v;
}

}  // namespace dsx
