// Checked access to a model directory's tensors for the weight binders of V4.1
// (weights.cpp) and V4 (weights_v4.cpp): every tensor is checked against what the
// config expects (presence, dtype, shape; errors name file and tensor) and recorded
// as used, so that leftovers can be reported.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <set>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/inventory.h"
#include "model/qmatrix.h"
#include "util/safetensors.h"

namespace dsx {

class ModelFiles;  // model/weights.h

class WeightBinder {
 public:
  // Tensors check_unused() lets pass: the draft stages mtp.<i>.* the config declares
  // and, when skip_vision, the vision / aligner modules and the image delimiters.
  WeightBinder(const ModelConfig& c, const ModelFiles& f, bool skip_vision);

  // The tensor `name`, which must have one of `dtypes` and this shape.
  const TensorView& tensor(const std::string& name, const std::vector<int64_t>& shape,
                           std::initializer_list<DType> dtypes);
  bool has(const std::string& name) const;

  // Small f32 parameter (stored F32 or BF16), widened.
  std::vector<float> f32(const std::string& name, std::vector<int64_t> shape);
  // Vector [n] stored BF16 or F32 (in this order of preference), widened.
  std::vector<float> vec(const std::string& name, int64_t n);
  // Plain matrix kept mapped (BF16 or F32; F32 only when f32_only).
  QMatrix dense(const std::string& name, int64_t n, int64_t k, bool f32_only = false);
  // Dense FP8 with BxB tiles of ue8m0 scales (B = quant_block).
  QMatrix fp8(const std::string& base, int64_t n, int64_t k);
  // Routed expert: packed e2m1 (low nibble first) + one ue8m0 scale per 32 inputs.
  QMatrix mxfp4(const std::string& base, int64_t n, int64_t k);

  // A tensor of the inventory, by its storage. Matrices: BF16 ones through dense(), F32
  // ones through dense() and then required to be F32, FP8 through fp8(), MXFP4 through
  // mxfp4(). Vectors, widened: [n] BF16 vectors through vec(), the others through f32().
  QMatrix matrix(const TensorSpec& t);
  std::vector<float> values(const TensorSpec& t);

  // The MoE experts of a layer (LayerWeights or LayerWeightsV4; tensor prefix p):
  // routed ffn.experts.<e>.{w1, w3, w2} (MXFP4) and the shared expert
  // ffn.shared_experts.{w1, w3, w2} (FP8); w1, w3 [I, D], w2 [D, I].
  template <class Layer>
  void experts(Layer& L, const std::string& p, int64_t E, int64_t I, int64_t D) {
    L.w1.resize(static_cast<size_t>(E));
    L.w2.resize(static_cast<size_t>(E));
    L.w3.resize(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) {
      const std::string q = p + "ffn.experts." + std::to_string(e) + ".";
      L.w1[static_cast<size_t>(e)] = mxfp4(q + "w1", I, D);
      L.w3[static_cast<size_t>(e)] = mxfp4(q + "w3", I, D);
      L.w2[static_cast<size_t>(e)] = mxfp4(q + "w2", D, I);
    }
    L.sw1 = fp8(p + "ffn.shared_experts.w1", I, D);
    L.sw3 = fp8(p + "ffn.shared_experts.w3", I, D);
    L.sw2 = fp8(p + "ffn.shared_experts.w2", D, I);
  }

  // Fails on the first stored tensor that was not bound and may not be ignored.
  void check_unused() const;

 private:
  bool ignorable(const std::string& n) const;
  static std::vector<float> widen(const TensorView& t);

  const ModelConfig& c_;
  const ModelFiles& f_;
  bool skip_vision_;
  std::set<std::string> used_;
};

}  // namespace dsx
