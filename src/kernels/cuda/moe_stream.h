// Internal: the one-token MoE decode as two one-wave streaming launches
// (moe_stream.cu), used by moe_decode() for T == 1 when DSX_MOE_STREAM=1 (opt-in: slower
// than the tensor-core kernels so far).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/moe.h"

namespace dsx::cuda {

bool moe_stream_enabled();
// Floats of the gu scratch ([S][2][I]: raw w1 / w3 sums of every slot).
size_t moe_stream_gu_floats(const MoeLayer& m, int topk);
// false: not applicable. hq: [S][I] QA8'd hidden vectors (out); gu: scratch.
bool moe_decode_stream(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk,
                       const int32_t* ids, const float* weights, DType yt, void* y, int64_t ldy, float* hq, float* gu,
                       cudaStream_t stream);

}  // namespace dsx::cuda
