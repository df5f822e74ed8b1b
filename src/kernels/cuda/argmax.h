// Greedy choice on the device: the index of the largest value of each row, with the
// host argmax's rules (runtime/sampler.h: first index of the largest value, NaNs never
// win, a NaN at index 0 gives 0), so that a decode loop copies one id per step instead
// of the vocabulary's logits.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace dsx::cuda {

// out[r] = argmax of x[r * ld .. r * ld + n) for r < rows (device pointers). One long
// 16-byte aligned row is split over many blocks whose candidates the last block combines;
// that path keeps a small workspace per output pointer (allocated on its first call
// outside a stream capture), so calls for one output must be ordered (one stream).
// copy (optional): a second destination of the ids, e.g. pinned host memory that the host
// reads after the stream passes an event (no separate copy on the stream).
void argmax_rows(const float* x, int64_t ld, int rows, int64_t n, int32_t* out, cudaStream_t stream,
                 int32_t* copy = nullptr);
// Allocates the many-block path's workspace of `out` now (outside a stream capture), so
// that an argmax_rows of one long row captured into a graph uses that path.
void argmax_reserve(const int32_t* out, cudaStream_t stream);

}  // namespace dsx::cuda
