// Host-side pieces shared by the MoE files (moe.cu: decode, moe_rows.cu: the
// expert-major decode of a few rows, moe_prefill.cu): launch constants, the layer
// checks, the FP8 view of the shared expert, and the expert-major path's entry points.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/moe.h"

namespace dsx::cuda::moe_detail {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxSlots = 16;

inline size_t align256(size_t v) { return (v + 255) & ~static_cast<size_t>(255); }

// Throws on a layer the decode / prefill kernels cannot take.
void check_layer(const MoeLayer& m, int topk);
// The kernels' view of an FP8_BLOCK matrix (the shared expert).
dev::WView fp8_view(const QMatrix& W);

// ---- expert-major decode of 2..kRowsMax rows (moe_rows.cu) ----------------------------
constexpr int kRowsMax = 16;
// Workspace bytes of moe_decode_rows for T rows (0 for T outside 2..kRowsMax); its first
// T * S * I floats hold the QA8'd hidden vectors, as moe_decode documents.
size_t rows_ws_bytes(const MoeLayer& m, int T, int topk);
// The expert-major path when it applies (BF16 mode or DSX_GEMV_MMA=2, qblock 32, T in
// 2..kRowsMax, shapes the one-token ring kernels take); false: not launched. Each row's
// output and hidden vectors equal bit for bit those of a one-row moe_decode of that row.
bool moe_decode_rows(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk, const int32_t* ids,
                     const float* weights, DType yt, void* y, int64_t ldy, void* ws, size_t ws_bytes,
                     cudaStream_t stream);
// Whether the one-token ring kernels take this layer (moe.cu; the expert-major kernels
// reproduce their arithmetic, so they require it).
bool ring_t1_supported(const MoeLayer& m, int topk);

}  // namespace dsx::cuda::moe_detail
