// EXPERIMENTAL (opt-in, DSX_GEMV_BULK=1): measured slower than the default tensor-core
// GEMV on the H200 (wo_b [5120, 8192]: 38-42 us vs 27 us; ~20 % of DRAM bandwidth, warps
// mostly stalled on long-scoreboard waits); kept, tested, for further work. Untested
// hypothesis: 16 small row copies per stage make the bulk-copy engine's request rate the
// limit; next experiment: one 2D tensor-map copy (cp.async.bulk.tensor) per stage.
//
// Decode GEMV for FP8_BLOCK weights with QA8'd activations (T <= 2), streamed by the
// bulk-copy engine (gemv.h semantics; the tensor-core arithmetic of gemv_device.cuh:
// exact f16 operands, one mma chain per 32-element scale block, f32 accumulation).
//
// A block owns a contiguous range of 16-row tiles. Its weight bytes are copied in
// stages of 16 rows x 512 bytes (one cp.async.bulk per row, completing on an mbarrier)
// by a producer warp, kNS stages deep, starting before the grid dependency wait: the
// bytes in flight live in shared memory, not in registers. Eight consumer warps take
// 64 columns each of a stage (two scale blocks): ldmatrix of the e4m3 bytes, hardware
// e4m3 -> f16 conversion, two m16n8k16 mma per block against the QA8 codes of x (staged
// once per block as f16 codes + scales), then the block sum times both scales. The k
// order inside a 16-wide mma step is permuted identically for A and B (lane c holds
// k = 4c .. 4c+3), which leaves the sum unchanged. At the end of a tile the eight warps'
// partial sums are added in warp order (deterministic).
#include <algorithm>
#include <cstdint>

#include "kernels/cuda/gemv.h"
#include "kernels/cuda/gemv_bulk.h"
#include "kernels/cuda/gemv_device.cuh"
#include "kernels/cuda/gemv_launch.h"
#include "util/error.h"

namespace dsx::cuda {

namespace {

constexpr int kConsumers = 8;
constexpr int kThreads = (kConsumers + 1) * 32;  // + one producer warp
constexpr int kMaxT = 2;
// Stage geometry: C bytes of each of the 16 rows per stage, NS stages in flight.
template <int C>
struct Geo {
  static constexpr int kCols = C;
  static constexpr int kNS = C >= 1024 ? 4 : 6;
  static constexpr int kRowStride = C + 16;  // padded: conflict-free ldmatrix
  static constexpr int kStageBytes = 16 * kRowStride;
  static constexpr int kWarpCols = C / kConsumers;  // bytes (= elements) per warp per stage
};

struct BulkParams {
  const uint8_t* w;
  const uint8_t* s;  // e8m0 tiles [ceil(N / B), sc_cols]
  int64_t N;
  int K;
  int sc_cols, wshift;
  int64_t n_tiles, blocks;
  int kc;  // stages per tile: ceil(K / 512)
  const void* x;
  int xt;
  int64_t ldx;
  int T;
  void* y;
  int yt;
  int64_t ldy;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* b, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred p;\n"
      "WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t"
      "@!p bra WAIT_%=;\n\t}" ::"r"(smem_addr(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// e4m3 pair (low byte -> low half) to f16x2, exact
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t v16) {
  uint32_t h;
  const uint16_t e = static_cast<uint16_t>(v16);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(e));
  return h;
}
__device__ __forceinline__ float e8m0_f32(uint32_t u) {
  return __uint_as_float(u == 0 ? 0x00400000u : (u >= 255 ? 0x7fc00000u : (u << 23)));
}
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumers * 32) : "memory"); }

template <int C>
__global__ void __launch_bounds__(kThreads) gemv_bulk_kernel(const BulkParams p) {
  using G = Geo<C>;
  constexpr int kNS = G::kNS, kStageCols = G::kCols, kRowStride = G::kRowStride, kStageBytes = G::kStageBytes;
  constexpr int kWC = G::kWarpCols;
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* stages = smem;                                               // kNS x 16 x kRowStride
  uint16_t* xs = reinterpret_cast<uint16_t*>(smem + kNS * kStageBytes);  // [T][K] f16 codes
  float* xsc = reinterpret_cast<float*>(xs + static_cast<int64_t>(p.T) * p.K);  // [T][K / 32]
  uint8_t* wsc = reinterpret_cast<uint8_t*>(xsc + static_cast<int64_t>(p.T) * (p.K / 32));  // [2][sc_cols]
  __shared__ uint64_t full[kNS], empty[kNS];
  __shared__ float red[2][kConsumers][16][kMaxT];

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t b = blockIdx.x;
  const int64_t t0 = b * p.n_tiles / p.blocks, t1 = (b + 1) * p.n_tiles / p.blocks;
  const int n_st = static_cast<int>((t1 - t0) * p.kc);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kNS; ++i) {
      mbar_init(&full[i], 1);
      mbar_init(&empty[i], kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == kConsumers) {
    // ---- producer: weights only, so it starts before the grid dependency wait
    dev::pdl_launch_dependents();
    int slot = 0, use = 0, kc = 0;
    int64_t tile = t0;
    for (int i = 0; i < n_st; ++i) {
      if (use > 0) mbar_wait(&empty[slot], static_cast<uint32_t>((use - 1) & 1));
      const int len = min(kStageCols, p.K - kc * kStageCols);
      if (lane == 0) mbar_expect_tx(&full[slot], static_cast<uint32_t>(16 * len));
      __syncwarp();
      if (lane < 16) {
        const int64_t row = min(tile * 16 + lane, p.N - 1);
        bulk_copy(stages + slot * kStageBytes + lane * kRowStride, p.w + row * p.K + static_cast<int64_t>(kc) * kStageCols,
                  static_cast<uint32_t>(len), &full[slot]);
      }
      if (++slot == kNS) slot = 0, ++use;
      if (++kc == p.kc) kc = 0, ++tile;
    }
    return;
  }

  // ---- consumers: stage QA8(x) as f16 codes + scales (after the previous kernel)
  dev::pdl_wait();
  {
    const int nb = p.K / 32;
    for (int q = warp; q < p.T * nb; q += kConsumers) {
      const int t = q / nb, kb = q % nb;
      const int64_t k = static_cast<int64_t>(kb) * 32 + lane;
      float v[1] = {dev::load_act(p.x, p.xt, t * p.ldx + k)};
      uint8_t c[1];
      const float sc = dev::qa8_warp_block<1>(v, c);
      xs[static_cast<int64_t>(t) * p.K + k] = __half_as_ushort(__float2half_rn(e4m3_to_f32(c[0])));
      if (lane == 0) xsc[t * nb + kb] = sc;
    }
  }
  // weight scales of the first tile (the next tile's are loaded a tile ahead)
  const int ctid = threadIdx.x;  // < 256 (consumers)
  if (t1 > t0)
    for (int j = ctid; j < p.sc_cols; j += kConsumers * 32) wsc[j] = p.s[((t0 * 16) >> p.wshift) * p.sc_cols + j];
  consumer_sync();
  dev::pdl_launch_dependents();

  const int g = lane >> 2, c = lane & 3;
  const int nb = p.K / 32;
  // ldmatrix row address of this lane: matrix mi = lane / 8 (rows +8 for odd, +16 bytes for >= 2)
  const int mi = lane >> 3, ri = lane & 7;
  const int lm_off = (ri + 8 * (mi & 1)) * kRowStride + 16 * (mi >> 1) + warp * kWC;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  int parity_tile = 0;
  uint8_t next_sc[4] = {0, 0, 0, 0};  // the next tile's scales (sc_cols <= 1024)
  int slot = 0, use = 0, kc = 0;
  int64_t tile = t0;
  for (int i = 0; i < n_st; ++i) {
    const int len = min(kStageCols, p.K - kc * kStageCols);
    if (kc == 0 && tile + 1 < t1) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int j = ctid + q * kConsumers * 32;
        if (j < p.sc_cols) next_sc[q] = __ldg(p.s + (((tile + 1) * 16) >> p.wshift) * p.sc_cols + j);
      }
    }
    mbar_wait(&full[slot], static_cast<uint32_t>(use & 1));
    if (warp * kWC < len) {
      const uint8_t* st = stages + slot * kStageBytes;
      const uint8_t* srow = wsc + parity_tile * p.sc_cols;
#pragma unroll
      for (int h = 0; h < kWC / 32; ++h) {
        if (warp * kWC + h * 32 >= len) break;  // (short last stage of a row)
        const int kb = (kc * kStageCols + warp * kWC + h * 32) / 32;  // scale block
        uint32_t r[4];
        ldsm_x4(r, st + lm_off + h * 32);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int s2 = 0; s2 < 2; ++s2) {
          const uint32_t a0 = e4m3x2_f16x2(r[2 * s2] & 0xffffu), a2 = e4m3x2_f16x2(r[2 * s2] >> 16);
          const uint32_t a1 = e4m3x2_f16x2(r[2 * s2 + 1] & 0xffffu), a3 = e4m3x2_f16x2(r[2 * s2 + 1] >> 16);
          uint32_t b0 = 0, b1 = 0;
          if (g < p.T) {
            const uint2 bv = *reinterpret_cast<const uint2*>(xs + static_cast<int64_t>(g) * p.K + kb * 32 + s2 * 16 + 4 * c);
            b0 = bv.x;
            b1 = bv.y;
          }
          dev::mma_f16_16816(d, a0, a1, a2, a3, b0, b1);
        }
        const float ws = e8m0_f32(srow[(kb * 32) >> p.wshift]);
        const int n0 = 2 * c, n1 = 2 * c + 1;
        const float f0 = n0 < p.T ? ws * xsc[n0 * nb + kb] : 0.f;
        const float f1 = n1 < p.T ? ws * xsc[n1 * nb + kb] : 0.f;
        acc[0] = fmaf(d[0], f0, acc[0]);
        acc[1] = fmaf(d[1], f1, acc[1]);
        acc[2] = fmaf(d[2], f0, acc[2]);
        acc[3] = fmaf(d[3], f1, acc[3]);
      }
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
    if (kc == p.kc - 1) {
      // end of the tile: the warps' partial sums, added in warp order
      float(*rd)[16][kMaxT] = red[parity_tile];
      if (2 * c < kMaxT) {
        rd[warp][g][2 * c] = acc[0];
        rd[warp][g + 8][2 * c] = acc[2];
      }
      if (2 * c + 1 < kMaxT) {
        rd[warp][g][2 * c + 1] = acc[1];
        rd[warp][g + 8][2 * c + 1] = acc[3];
      }
      if (tile + 1 < t1) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int j = ctid + q * kConsumers * 32;
          if (j < p.sc_cols) wsc[(parity_tile ^ 1) * p.sc_cols + j] = next_sc[q];
        }
      }
      consumer_sync();
      if (threadIdx.x < 16 * p.T) {
        const int rl = threadIdx.x & 15, t = threadIdx.x >> 4;
        const int64_t row = tile * 16 + rl;
        if (row < p.N) {
          float sum = 0.f;
#pragma unroll
          for (int w = 0; w < kConsumers; ++w) sum += rd[w][rl][t];
          dev::store_act(p.y, p.yt, t * p.ldy + row, sum);
        }
      }
      parity_tile ^= 1;
      acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
    }
    if (++slot == kNS) slot = 0, ++use;
    if (++kc == p.kc) kc = 0, ++tile;
  }
}

template <int C>
bool launch_bulk(BulkParams p, cudaStream_t stream) {
  using G = Geo<C>;
  auto kern = gemv_bulk_kernel<C>;
  p.kc = (p.K + C - 1) / C;
  const size_t smem = static_cast<size_t>(G::kNS) * G::kStageBytes + static_cast<size_t>(p.T) * p.K * 2 +
                      static_cast<size_t>(p.T) * (p.K / 32) * 4 + 2 * static_cast<size_t>(p.sc_cols);
  if (smem > detail::max_dynamic_smem(kern)) return false;
  const int occ = detail::occupancy(kern, kThreads, smem);
  p.blocks = std::min<int64_t>(p.n_tiles, static_cast<int64_t>(occ) * sm_count());
  if ((p.n_tiles + p.blocks - 1) / p.blocks * p.kc > (int64_t{1} << 30)) return false;
  detail::launch_pdl(kern, dim3(static_cast<unsigned>(p.blocks)), dim3(kThreads), smem, stream, p);
  return true;
}

// DSX_BULK_COLS: bytes of each row per stage (512 or 1024, default 1024)
int bulk_cols() {
  static const int v = env_int("DSX_BULK_COLS", 1024);
  return v;
}

}  // namespace

bool gemv_bulk_enabled() {
  static const bool v = env_int("DSX_GEMV_BULK", 0) != 0;  // opt-in: slower than gemv_mma so far
  return v;
}

bool gemv_bulk(const QMatrix& W, DType xt, const void* x, int64_t ldx, int T, DType yt, void* y, int64_t ldy,
               const GemvOpts& o, cudaStream_t stream) {
  if (!gemv_bulk_enabled()) return false;
  if (W.fmt != WFormat::FP8_BLOCK || !o.qa8 || o.qblock != 32 || o.groups != 1 || T < 1 || T > kMaxT) return false;
  if (!(W.block == 32 || W.block == 64 || W.block == 128) || W.cols % 32 != 0 || W.cols > (1 << 20)) return false;
  if (!detail::aligned16(W.data)) return false;
  int dev = 0, major = 0;
  DSX_CUDA_CHECK(cudaGetDevice(&dev));
  DSX_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major < 9) return false;
  const int sms = sm_count();
  BulkParams p{};
  p.w = W.data;
  p.s = W.scale;
  p.N = W.rows;
  p.K = static_cast<int>(W.cols);
  p.sc_cols = static_cast<int>((W.cols + W.block - 1) / W.block);
  int sh = 0;
  while ((1 << sh) < W.block) ++sh;
  p.wshift = sh;
  p.n_tiles = (W.rows + 15) / 16;
  if (p.n_tiles < sms) return false;  // too few tiles to fill the device: the other kernels split K
  if (p.sc_cols > 4 * kConsumers * 32) return false;
  p.x = x;
  p.xt = static_cast<int>(xt);
  p.ldx = ldx;
  p.T = T;
  p.y = y;
  p.yt = static_cast<int>(yt);
  p.ldy = ldy;
  return bulk_cols() >= 1024 ? launch_bulk<1024>(p, stream) : launch_bulk<512>(p, stream);
}

}  // namespace dsx::cuda
