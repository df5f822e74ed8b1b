// Internal helpers of gemm.cu used by moe.cu (host side; not part of the public API).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/quant_act.h"
#include "model/qmatrix.h"

namespace dsx::cuda::detail {

// y[r, c] = x[r, c] converted (strided 2-D copy).
void convert2d(DType xt, const void* x, int64_t ldx, DType yt, void* y, int64_t ldy, int64_t rows, int64_t cols,
               cudaStream_t stream);

}  // namespace dsx::cuda::detail
