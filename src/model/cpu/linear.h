// CPU matrix products against weights in their stored formats, dequantized on
// the fly (f32 accumulation). Threaded over output rows.
#pragma once
#include <cstdint>

#include "model/qmatrix.h"

namespace dsx::cpu {

// y[t, n] = sum_k x[t, k] * W[n, k] for t < T, n < W.rows. x is [T, W.cols].
void matmul(const float* x, int64_t T, const QMatrix& W, float* y);

// Same, restricted to weight rows [r0, r1): y[t, n - r0] (used by grouped products).
void matmul_rows(const float* x, int64_t T, const QMatrix& W, int64_t r0, int64_t r1, float* y, int64_t ldy);

float dot(const float* a, const float* b, int64_t n);

}  // namespace dsx::cpu
