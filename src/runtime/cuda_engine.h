// The CUDA engine (src/backend/cuda) behind the Engine / Session interface, registered
// as backend "cuda" when the build has CUDA. Also the synthetic release-shaped engine of
// the benchmark and the roofline figures it reports.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "runtime/engine.h"

namespace dsx {

std::unique_ptr<Engine> load_cuda_engine(const std::string& model_dir, const EngineOptions& opts);

// A synthetic model with full release dimensions and random weights in the official
// formats, generated on the device (`dsx bench --synthetic v41-flash`); cfg from
// synthetic_v41_flash_config (model/cost_model.h).
std::unique_ptr<Engine> make_synthetic_cuda_engine(const ModelConfig& cfg, const EngineOptions& opts, uint64_t seed);

struct CudaEngineStats {
  int64_t weight_bytes = 0;         // device memory of the weights
  int64_t decode_weight_bytes = 0;  // weight bytes one decode step must read (top-k experts)
  int64_t workspace_bytes = 0;      // the engine's shared scratch
  double copy_bandwidth_gb_s = 0;   // measured device-to-device copy bandwidth
};
CudaEngineStats cuda_engine_stats(Engine& e);

}  // namespace dsx
