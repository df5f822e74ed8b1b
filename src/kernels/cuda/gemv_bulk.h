// Internal: the bulk-copy tensor-core decode GEMV for FP8_BLOCK weights with QA8
// (gemv_bulk.cu), used by gemv() for T <= 2 when it applies and DSX_GEMV_BULK=1
// (experimental, opt-in).
#pragma once
#include <cuda_runtime.h>

#include "kernels/cuda/gemv.h"

namespace dsx::cuda {

bool gemv_bulk_enabled();
// false: not applicable (the caller uses another kernel).
bool gemv_bulk(const QMatrix& W, DType xt, const void* x, int64_t ldx, int T, DType yt, void* y, int64_t ldy,
               const GemvOpts& o, cudaStream_t stream);

}  // namespace dsx::cuda
