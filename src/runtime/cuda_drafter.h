// The CUDA DSpark drafter (backend/cuda/dspark_drafter.h) behind the Drafter interface,
// registered as drafter backend "cuda" (runtime/dspark_decoding.h load_drafter) when the
// build has CUDA: the stages on the device in the engine's precision.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "model/dspark.h"

namespace dsx {

// The stages of a model directory on the device; precision "fp32" | "bf16".
std::unique_ptr<Drafter> load_cuda_drafter(const std::string& model_dir, const std::string& precision);

// Random stage weights at cfg's shapes (`dsx bench --synthetic`): cfg is a V4.1 config
// with the dspark_* keys set, n_stages stages.
std::unique_ptr<Drafter> make_synthetic_cuda_drafter(const ModelConfig& cfg, int n_stages, const std::string& precision,
                                                     uint64_t seed);

}  // namespace dsx
