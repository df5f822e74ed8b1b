// Internal: the one-wave streaming GEMV for one token (gemv_stream.cu), used by gemv()
// when it applies (see gemv_stream_mode in gemv_stream.cu for the DSX_GEMV_STREAM switch).
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/gemv.h"
#include "kernels/cuda/gemv_device.cuh"

namespace dsx::cuda {

int gemv_stream_mode();

// Whether a one-token product with W may run this kernel (by the switch and W's format
// and size; it may still decline a shape). Callers that must reproduce the one-token
// result of another kernel (gemv_rows.h) use this to stay away.
bool gemv_stream_may_take(const QMatrix& W);

// false: not applicable (caller uses another kernel). qa8: QA8 applies to this product.
bool gemv_stream(const QMatrix& W, const dev::WView& wv, DType xt, const void* x, int64_t ldx, int T, DType yt,
                 void* y, int64_t ldy, const GemvOpts& o, bool qa8, cudaStream_t stream);

}  // namespace dsx::cuda
