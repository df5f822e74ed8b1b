// Greedy choice on the device: the index of the largest value of each row, with the
// host argmax's rules (runtime/sampler.h: first index of the largest value, NaNs never
// win, a NaN at index 0 gives 0), so that a decode loop copies one id per step instead
// of the vocabulary's logits.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dsx::cuda {

// out[r] = argmax of x[r * ld .. r * ld + n) for r < rows (device pointers).
void argmax_rows(const float* x, int64_t ld, int rows, int64_t n, int32_t* out, cudaStream_t stream);

}  // namespace dsx::cuda
