// The DeepSeek V4.1 forward on NVIDIA GPUs (Hopper, sm_90a): the same computation
// as the CPU reference (src/model/v41_cpu.cpp), step for step, on the CUDA kernels
// of src/kernels/cuda. Weights stay in their stored formats on the device; sessions
// keep their state on the device (the compact cache forms of kv_cache.h) with the
// same snapshot format as the CPU engine; a one-token decode step is captured as a
// CUDA graph once and replayed.
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "model/config.h"
#include "runtime/engine.h"

namespace dsx {

// Loads a model directory on the GPU (registered as backend "cuda").
std::unique_ptr<Engine> load_cuda_engine(const std::string& model_dir, const EngineOptions& opts);

// A synthetic model with full release dimensions and random weights in the
// official formats, generated on the device (`dsx bench --synthetic v41-flash`).
// `layers` backbone layers follow the release schedule pattern (window, Engram,
// ratio-2 KV source and reuse, ratio-1 KV source / candidate source, re-index).
ModelConfig synthetic_v41_flash_config(int layers);
std::unique_ptr<Engine> make_synthetic_cuda_engine(const ModelConfig& cfg, const EngineOptions& opts, uint64_t seed);

// Per-token figures of a CUDA engine for the roofline report.
struct CudaEngineStats {
  int64_t weight_bytes = 0;             // device memory of the weights
  int64_t decode_weight_bytes = 0;      // weight bytes one decode step must read (top-k experts)
  double copy_bandwidth_gb_s = 0;       // measured device-to-device copy bandwidth
};
CudaEngineStats cuda_engine_stats(Engine& e);
// Weight bytes one decode step must read (everything but the unselected experts;
// the head once; one embedding row), from the configuration.
int64_t v41_decode_weight_bytes(const ModelConfig& cfg);
// Bytes of session state a decode step at `context` tokens reads (window rows,
// selected compressed rows, index keys scored).
int64_t cuda_decode_state_bytes(const ModelConfig& cfg, int64_t context);

}  // namespace dsx
