// Device pieces of the MoE decode kernels shared by the one-token ring kernels (moe.cu)
// and the expert-major kernels of a few rows (moe_rows.cu): the view of a routed
// expert, the per-warp span stream over a sequence of pieces, the warp arrival count
// and the staged layout of the down projection's activations.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/gemv_ring_device.cuh"

namespace dsx::cuda::moe_dev {

// The view of a routed expert's MXFP4 matrix with K inputs (K / 2 data bytes and K / 32
// scales per row; tiled: MoeLayer::tiled).
__device__ __forceinline__ dev::WView expert_view(const uint8_t* w, const uint8_t* s, int K, int tiled) {
  dev::WView v;
  v.w = w;
  v.s = s;
  v.row_bytes = K / 2;
  v.sc_cols = K / 32;
  v.tiled = tiled;
  return v;
}

// ---------------------------------------------------------------------------------
// One-token kernels on the shared-memory span ring (gemv_device.cuh): each warp walks a
// sequence of pieces (16 rows x a span range of one weight matrix) and its copies run
// U spans ahead across piece boundaries, so a warp's stream never drains between
// units. Same arithmetic per piece as stream_tile. T > 1 (or where these do not fit):
// the per-tile register-ring kernels above, which also measured slower at T = 1.
// U: spans in flight per warp (ring of U + 1 slots of 1 KB). U = 4 is a bit faster on the
// H200 than U = 8: MoE 69.2 -> 67.6 us, decode step 2.000 -> 1.978 ms; U = 8 measured
// slower again in later sessions (docs/experiments.md). (Forcing 3 up blocks per SM with
// U = 4, 75 registers, measured slower: 72.7 us.)
template <int U>
constexpr size_t ring_bytes(int warps) {
  return static_cast<size_t>(warps) * (U + 1) * 1024;
}
constexpr int kRingU = 4;  // the one-token kernels' spans in flight per warp

struct Piece {
  dev::WView v;
  int64_t row0 = 0, row_last = 0;
  int s_lo = 0, s_hi = 0;
  bool fp4 = false;
};

// The copy cursor of a warp over its pieces (piece_at(i), i < count) and its ring.
template <int U, typename PieceAt>
struct SpanStream {
  uint4* ring;
  int lane, NB, count;
  PieceAt piece_at;
  int li = 0;
  dev::RingLoad ld;
  // this lane's shared address in slot 0; byte offsets of the slots to fill / read next
  uint32_t ring_lane = 0, off_in = 0, off_out = 0;

  // points the copy cursor at piece li, or the next non-empty one (none: ld.left == 0)
  __device__ void load_piece() {
    for (; li < count; ++li) {
      const Piece q = piece_at(li);
      ld.set(q.v, q.row0, q.row_last, q.s_lo, q.s_hi, lane);
      if (ld.left > 0) return;
    }
  }
  __device__ void issue_one() {
    ld.issue_at(ring_lane + off_in);
    off_in = dev::next_ring_slot<U>(off_in);
    if (ld.left == 0 && li < count) {
      ++li;
      load_piece();
    }
  }
  __device__ void start() {
    load_piece();
#pragma unroll 1
    for (int u = 0; u < U; ++u) issue_one();
  }
  // acc += the next piece (q, which must be piece_at of the consumer's position); bs /
  // sas: staged B (stage_b_mma) of its one token.
  template <WFormat F>
  __device__ void consume_piece(const Piece& q, float (&acc)[1][2], const uint32_t* bs, const float* sas,
                                const uint4* bzero) {
    dev::with_ring_cons<F>(NB, q.v, [&](auto& cons) {
      cons.set(q.v, q.row0, q.row_last, bs, sas, NB, 1, NB, bzero, lane);
      // (not unrolled: the up kernel's code 98 -> 59 KB, the down kernel's 73 -> 40 KB;
      // a warp's FP8 and MXFP4 loops and the two kernels share the SMs' instruction
      // caches: 1.482 -> 1.466 ms per step, s17 run9; the ring GEMV's loop at unroll 1:
      // no change)
#pragma unroll 1
      for (int s = q.s_lo; s < q.s_hi; ++s) {
        dev::cp_async_wait<U - 1>();
        cons.span_at(ring_lane + off_out, s, acc[0], lane);
        issue_one();
        off_out = dev::next_ring_slot<U>(off_out);
      }
    });
    dev::mma_acc_finish<F, 1>(acc);
  }
  // The spans of the next piece q (piece_at of the consumer's position) one by one:
  // span(address of this lane's bytes in the slot, span index) once each has landed.
  template <typename SpanFn>
  __device__ __forceinline__ void consume_spans(const Piece& q, SpanFn&& span) {
#pragma unroll 1
    for (int s = q.s_lo; s < q.s_hi; ++s) {
      dev::cp_async_wait<U - 1>();
      span(ring_lane + off_out, s);
      issue_one();
      off_out = dev::next_ring_slot<U>(off_out);
    }
  }
  __device__ void finish() { dev::cp_async_wait<0>(); }
};
template <int U, typename PieceAt>
__device__ SpanStream<U, PieceAt> make_stream(uint4* ring, int lane, int NB, int count, PieceAt at) {
  SpanStream<U, PieceAt> st{ring, lane, NB, count, at};
  st.ring_lane = dev::smem_u32(ring + lane);
  return st;
}

// True in every lane of the last of `n` warps to arrive at *cnt (after each wrote its
// partial sums to shared memory; the last one may then read them all).
__device__ __forceinline__ bool last_warp_in(unsigned* cnt, unsigned n, int lane) {
  __syncwarp();
  unsigned old = 0;
  if (lane == 0) {
    __threadfence_block();
    old = atomicAdd(cnt, 1u);
  }
  old = __shfl_sync(0xffffffffu, old, 0);
  if (old != n - 1) return false;
  __threadfence_block();
  return true;
}

// The one-token down kernel's staged activations (in 32-bit words): QA8(h) of the routed
// slots in the MXFP4 B order ([topk][NBI][16], stage_b_mma's layout) and their scales
// ([topk][NBI]), then, at a 16-byte boundary, the shared expert's in the FP8 B order
// ([NBI][16]) and scales ([NBI]). The up kernel writes it to global memory, the down
// kernel's blocks copy it into shared memory as is.
struct DownStage {
  int64_t sas_r, bs_s, sas_s, words;
  __host__ __device__ DownStage(int topk, int NBI) {
    sas_r = static_cast<int64_t>(topk) * NBI * 16;
    bs_s = (static_cast<int64_t>(topk) * NBI * 17 + 3) & ~int64_t{3};
    sas_s = bs_s + static_cast<int64_t>(NBI) * 16;
    words = (sas_s + NBI + 3) & ~int64_t{3};
  }
};

}  // namespace dsx::cuda::moe_dev
