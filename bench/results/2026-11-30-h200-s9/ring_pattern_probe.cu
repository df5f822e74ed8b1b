// Probe: how fast can the decode weight kernels' span ring read HBM, by access shape?
// Every warp streams its own tile of 16 rows (row_bytes apart) through a shared-memory
// ring of U slots of 1 KB filled by cp.async (16 B per lane, 2 per lane per slot), waits
// for the oldest slot, reads its bytes back (LDS) and folds them into a checksum, as the
// ring kernels do, but without any arithmetic. Shapes of one 1 KB slot:
//   mode 0: 16 rows x 64 B (the kernels' span: lane's rows g, g+8, 16 B at 16 (lane & 3))
//   mode 1:  4 rows x 256 B
//   mode 2:  1 row x 1 KB (contiguous)
// hint: cp.async with .L2::256B (the kernels') or without.
// Build: nvcc -O3 -gencode=arch=compute_90a,code=sm_90a ring_pattern_probe.cu -o probe
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>

__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
template <bool HINT>
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  if constexpr (HINT)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wait_n() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// byte offset in the tile (16 rows x row_bytes) of lane's k-th 16 B (k = 0, 1) of span s
template <int MODE>
__device__ __forceinline__ int64_t off(int lane, int k, int s, int row_bytes) {
  if constexpr (MODE == 0) {
    const int row = (lane >> 2) + 8 * k;
    return static_cast<int64_t>(row) * row_bytes + 64 * s + 16 * (lane & 3);
  } else if constexpr (MODE == 1) {  // span s covers rows 4 (s % 4) .. +3, bytes 256 (s / 4) ..
    const int row = 4 * (s & 3) + 2 * k + (lane >> 4);
    return static_cast<int64_t>(row) * row_bytes + 256 * (s >> 2) + 16 * (lane & 15);
  } else {  // span s = row s % 16, bytes 1024 (s / 16) ..
    const int row = s & 15;
    return static_cast<int64_t>(row) * row_bytes + 1024 * (s >> 4) + 512 * k + 16 * lane;
  }
}

template <int U, int MODE, bool HINT>
__global__ void __launch_bounds__(256) stream_kernel(const uint8_t* w, int64_t tile_bytes, int row_bytes, int ntiles,
                                                     uint32_t* out) {
  extern __shared__ __align__(128) uint4 sm[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint4* ring = sm + warp * (U + 1) * 64;
  const int gw = blockIdx.x * 8 + warp, nw = gridDim.x * 8;
  const int nsp = 16 * row_bytes / 1024;  // spans per tile
  uint32_t acc = 0;
  for (int t = gw; t < ntiles; t += nw) {
    const uint8_t* base = w + static_cast<int64_t>(t) * tile_bytes;
    int sin = 0, slot_in = 0, slot_out = 0;
    for (int u = 0; u < U; ++u, ++sin) {
      for (int k = 0; k < 2; ++k) cp16<HINT>(smem_u32(ring + slot_in * 64 + 32 * k + lane), base + off<MODE>(lane, k, sin, row_bytes));
      commit();
      slot_in = slot_in == U ? 0 : slot_in + 1;
    }
    for (int s = 0; s < nsp; ++s) {
      wait_n<U - 1>();
      const uint4 a = ring[slot_out * 64 + lane], b = ring[slot_out * 64 + 32 + lane];
      acc ^= a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w;
      if (sin < nsp)
        for (int k = 0; k < 2; ++k) cp16<HINT>(smem_u32(ring + slot_in * 64 + 32 * k + lane), base + off<MODE>(lane, k, sin, row_bytes));
      commit();
      ++sin;
      slot_in = slot_in == U ? 0 : slot_in + 1;
      slot_out = slot_out == U ? 0 : slot_out + 1;
    }
    wait_n<0>();
  }
  if (acc == 0x12345678u) out[0] = acc;
}

template <int U, int MODE, bool HINT>
void run(const uint8_t* w, size_t bytes, int row_bytes, int blocks_per_sm, int sms, uint32_t* out) {
  const int64_t tile = 16LL * row_bytes;
  const int ntiles = static_cast<int>(bytes / tile);
  const size_t smem = 8 * (U + 1) * 1024;
  auto k = stream_kernel<U, MODE, HINT>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  const int grid = sms * blocks_per_sm;
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  k<<<grid, 256, smem>>>(w, tile, row_bytes, ntiles, out);  // warm
  cudaEventRecord(e0);
  const int reps = 5;
  for (int r = 0; r < reps; ++r) k<<<grid, 256, smem>>>(w, tile, row_bytes, ntiles, out);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  const double gbs = static_cast<double>(ntiles) * tile * reps / (ms * 1e-3) / 1e9;
  printf("U=%2d mode=%d hint=%d row_bytes=%5d blocks/SM=%d: %7.1f GB/s  (%s)\n", U, MODE, HINT ? 1 : 0, row_bytes,
         blocks_per_sm, gbs, cudaGetErrorString(cudaGetLastError()));
}

int main(int argc, char** argv) {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const size_t bytes = size_t(1) << 30;
  if (argc > 1) {  // one decode-sized read: argv[1] MB of tiles of 16 rows x 2560 B (the MoE up's MXFP4 rows)
    const size_t mb = static_cast<size_t>(atoi(argv[1])) << 20;
    uint8_t* w;
    uint32_t* out;
    cudaMalloc(&w, bytes);
    cudaMalloc(&out, 4);
    cudaMemset(w, 1, bytes);
    run<4, 0, true>(w, mb, 2560, 2, sms, out);
    run<8, 0, true>(w, mb, 2560, 2, sms, out);
    run<12, 0, true>(w, mb, 2560, 2, sms, out);
    run<8, 2, false>(w, mb, 2560, 2, sms, out);
    return 0;
  }
  uint8_t* w;
  uint32_t* out;
  cudaMalloc(&w, bytes);
  cudaMalloc(&out, 4);
  cudaMemset(w, 1, bytes);
  for (int rb : {4096, 5120}) {
    run<4, 0, true>(w, bytes, rb, 2, sms, out);
    run<8, 0, true>(w, bytes, rb, 2, sms, out);
    run<8, 0, false>(w, bytes, rb, 2, sms, out);
    run<12, 0, true>(w, bytes, rb, 2, sms, out);
    run<4, 1, true>(w, bytes, rb, 2, sms, out);
    run<8, 1, true>(w, bytes, rb, 2, sms, out);
    run<4, 2, true>(w, bytes, rb, 2, sms, out);
    run<8, 2, true>(w, bytes, rb, 2, sms, out);
    run<8, 2, false>(w, bytes, rb, 2, sms, out);
  }
  return 0;
}
