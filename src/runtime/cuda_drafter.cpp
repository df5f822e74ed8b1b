#include "runtime/cuda_drafter.h"

#include "backend/cuda/dspark_drafter.h"
#include "backend/cuda/runner.h"
#include "runtime/dspark_decoding.h"
#include "util/error.h"

namespace dsx {

std::unique_ptr<Drafter> load_cuda_drafter(const std::string& dir, const std::string& precision) {
  if (!cuda::device_available()) fail("DSpark drafter cuda: no CUDA device is available");
  const cuda::Act act = cuda::parse_precision(precision);
  // (the CPU drafter's loading: the stage count, the tensors and their checks; the host
  // views are dropped once the weights are on the device)
  const std::unique_ptr<DSparkDrafter> host = DSparkDrafter::load(dir);
  return std::make_unique<cuda::CudaDrafter>(host->config(), host->weights(), act);
}

std::unique_ptr<Drafter> make_synthetic_cuda_drafter(const ModelConfig& cfg, int n_stages, const std::string& precision,
                                                     uint64_t seed) {
  if (!cuda::device_available()) fail("DSpark drafter cuda: no CUDA device is available");
  return cuda::CudaDrafter::synthetic(cfg, n_stages, cuda::parse_precision(precision), seed);
}

namespace {
struct Registration {
  Registration() {
    register_drafter_backend("cuda", [](const std::string& dir, const Engine& eng) {
      return load_cuda_drafter(dir, eng.options().precision);
    });
  }
} registration;
}  // namespace

}  // namespace dsx
