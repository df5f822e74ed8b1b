// Grouped expert GEMMs of the MoE prefill (moe_prefill, moe.h) on the tensor cores.
//
// The rows of a chunk are grouped by expert: grouped row p < Tk = T * topk is the entry
// perm[p] = t * topk + j (token t, slot j) of expert e for p in [offs[e], offs[e + 1]);
// with a shared expert, rows Tk + t (t < T) are token t again. Each group is cut into
// tiles of at most kGroupedTileRows rows, planned ON THE DEVICE from the counts
// (grouped_plan: no host synchronisation, graph-capturable); the product launches are
// sized by the upper bound of the tile count and the blocks beyond the plan exit.
//
//   grouped_gather_qa8  x -> xb:  QA8(x) of every grouped row, as bf16 (exact)
//   grouped_up          xb -> hq: g = Lin4(x; w1), u = Lin4(x; w3) (shared: FP8), then
//                                 h = w * silu(g) * u with the clamp and the BF16-mode
//                                 rounding points (moe_device.cuh), then QA8(h), as bf16
//   grouped_down        hq -> yp: Lin4(h; w2) (shared: FP8), f32
// One launch each over all experts and the shared expert. The weights are decoded in
// the kernel (MXFP4: e2m1 * 2^(s-127), FP8: e4m3 * 2^(s-127), both exact in bf16) and
// multiplied with the bf16-exact QA8 values by mma.sync m16n8k16 (bf16, f32
// accumulation): the products are exactly the model's, only the f32 summation order
// differs from the reference (and it is the same for a row whatever else the chunk
// holds: one lane sums one output over K in a fixed order).
//
// Row order of xb and hq ("B order"): row-major [rows, K] bf16 (raw bits), but within
// each group of 8 consecutive elements k = 8a + b the element b is stored at position
// 2b (b < 4) or 2(b - 4) + 1 (b >= 4), i.e. the order 0 4 1 5 2 6 3 7 (the pairs the
// mma fragments take; grouped_b_pos).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/moe.h"

namespace dsx::cuda {

constexpr int kGroupedTileRows = 64;  // rows (tokens) per tile, at most

// Position of element k in a B-order row.
constexpr int64_t grouped_b_pos(int64_t k) {
  const int64_t b = k & 7;
  return (k & ~int64_t{7}) | (b < 4 ? 2 * b : 2 * (b - 4) + 1);
}

// The grouping of one call (device pointers).
struct GroupedMoe {
  int T = 0, topk = 0;
  const int* counts = nullptr;   // [E] rows per expert
  const int* offs = nullptr;     // [E + 1] first grouped row per expert (exclusive scan)
  const int* perm = nullptr;     // [Tk] grouped row -> entry t * topk + j
  const float* weights = nullptr;  // [Tk] routing weights (entry order)
  int4* tiles = nullptr;         // plan: [grouped_max_tiles] {group, row0, rows, 0}; group E = shared
  int* n_tiles = nullptr;        // plan: number of tiles
};

// Whether the grouped kernels take this layer (otherwise moe_prefill keeps the dequant +
// cuBLAS path): D and I multiples of 32 (as moe_decode), the shared expert FP8 with 32,
// 64 or 128 tiles and at most 256 K blocks per row.
bool grouped_supported(const MoeLayer& m);

// Upper bound of the number of tiles of a call (the plan's capacity).
int grouped_max_tiles(const MoeLayer& m, int T, int topk);

// Tiles from counts / offs: experts in ascending id, then the shared expert.
void grouped_plan(const MoeLayer& m, const GroupedMoe& g, cudaStream_t stream);

// xb [rows, D] in the B order, rows = Tk (+ T with a shared expert): the QA8 values
// (blocks of m.qblock) of x [T, D] (type xt, row stride ldx) for each grouped row.
void grouped_gather_qa8(const MoeLayer& m, const GroupedMoe& g, DType xt, const void* x, int64_t ldx, uint16_t* xb,
                        cudaStream_t stream);

// hq [rows, I] in the B order from xb. bf16: the BF16-mode rounding points of the SwiGLU.
// gu (optional, tests): the raw f32 sums [rows, 2 I] (g in [0, I), u in [I, 2 I)).
void grouped_up(const MoeLayer& m, const GroupedMoe& g, const uint16_t* xb, bool bf16, uint16_t* hq, float* gu,
                cudaStream_t stream);

// yp [rows, D] f32 from hq.
void grouped_down(const MoeLayer& m, const GroupedMoe& g, const uint16_t* hq, float* yp, cudaStream_t stream);

}  // namespace dsx::cuda
