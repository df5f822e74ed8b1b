// Probe: mma.sync m16n8k32 e4m3 on this GPU: exactness of the f32 accumulation and throughput vs f16 m16n8k16.
#include <cstdio>
#include <cstdint>
#include <cmath>
#include <vector>
#include <random>
#include <cuda_fp8.h>
__device__ __forceinline__ void mma8(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// A[16][32], B[32][8] (k, n) bytes; D[16][8]; chain: nchain mmas accumulate (A, B of chain c at +c*...)
__global__ void one(const uint8_t* A, const uint8_t* B, float* D, int nchain) {
  int lane = threadIdx.x, g = lane >> 2, c = lane & 3;
  float d[4] = {0, 0, 0, 0};
  for (int ch = 0; ch < nchain; ++ch) {
    const uint8_t* a = A + ch * 512; const uint8_t* b = B + ch * 256;
    auto ra = [&](int row, int k0) { uint32_t v = 0; for (int i = 0; i < 4; ++i) v |= uint32_t(a[row * 32 + k0 + i]) << (8 * i); return v; };
    auto rb = [&](int k0, int n) { uint32_t v = 0; for (int i = 0; i < 4; ++i) v |= uint32_t(b[(k0 + i) * 8 + n]) << (8 * i); return v; };
    mma8(d, ra(g, 4 * c), ra(g + 8, 4 * c), ra(g, 16 + 4 * c), ra(g + 8, 16 + 4 * c), rb(4 * c, g), rb(16 + 4 * c, g));
  }
  D[g * 8 + 2 * c] = d[0]; D[g * 8 + 2 * c + 1] = d[1]; D[(g + 8) * 8 + 2 * c] = d[2]; D[(g + 8) * 8 + 2 * c + 1] = d[3];
}
template <int KIND>
__global__ void thr(float* out, int iters, uint32_t seed) {
  uint32_t a0 = seed * 3 + threadIdx.x, a1 = a0 ^ 0x3c3c3c3c, a2 = a0 * 7, a3 = a1 + 5, b0 = seed, b1 = seed ^ 0x1111;
  a0 &= 0x3f3f3f3f; a1 &= 0x3f3f3f3f; a2 &= 0x3f3f3f3f; a3 &= 0x3f3f3f3f; b0 &= 0x3f3f3f3f; b1 &= 0x3f3f3f3f;
  float d[4][4] = {};
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (KIND == 0) mma8(d[j], a0, a1, a2, a3, b0, b1); else mma16(d[j], a0, a1, a2, a3, b0, b1);
    }
  }
  float s = 0; for (int j = 0; j < 4; ++j) for (int k = 0; k < 4; ++k) s += d[j][k];
  out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
static float e4m3(uint8_t b) { __nv_fp8_e4m3 v; v.__x = b; return float(v); }
int main() {
  std::mt19937 rng(1);
  const int nchain = 4;
  std::vector<uint8_t> A(512 * nchain), B(256 * nchain);
  uint8_t *dA, *dB; float* dD;
  cudaMalloc(&dA, A.size()); cudaMalloc(&dB, B.size()); cudaMalloc(&dD, 128 * 4);
  double worst = 0, worst_rel_abs = 0; int bad = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    int mode = trial % 4;
    for (auto& x : A) { do x = rng() & 0xff; while ((x & 0x7f) == 0x7f); }
    for (auto& x : B) { do x = rng() & 0xff; while ((x & 0x7f) == 0x7f); }
    if (mode == 1) for (auto& x : A) x = (x & 0x80) | (x & 0x1c);           // e2m1-style codes
    if (mode == 2) for (size_t i = 0; i < B.size(); ++i) if (((i % 8) & 3) != 0) B[i] = 0;   // one column of 4 active
    if (mode == 3) { for (auto& x : A) x = (x & 0x87) | 0x38; }             // narrow exponent: cancellation
    cudaMemcpy(dA, A.data(), A.size(), cudaMemcpyHostToDevice); cudaMemcpy(dB, B.data(), B.size(), cudaMemcpyHostToDevice);
    one<<<1, 32>>>(dA, dB, dD, nchain);
    float D[128]; cudaMemcpy(D, dD, sizeof D, cudaMemcpyDeviceToHost);
    for (int m = 0; m < 16; ++m) for (int n = 0; n < 8; ++n) {
      double ex = 0, mag = 0;
      for (int ch = 0; ch < nchain; ++ch) for (int k = 0; k < 32; ++k) {
        double p = double(e4m3(A[ch * 512 + m * 32 + k])) * e4m3(B[ch * 256 + k * 8 + n]); ex += p; mag += fabs(p); }
      double err = fabs(D[m * 8 + n] - ex);
      if (err > worst) worst = err;
      if (mag > 0 && err / mag > worst_rel_abs) worst_rel_abs = err / mag;
      if (err != 0 && err > fabs(ex) * 1.2e-7 + 1e-30) ++bad;
    }
  }
  printf("precision: worst abs err %.3g, worst err/sum|p| %.3g, entries beyond f32 rounding of result: %d of %d\n", worst, worst_rel_abs, bad, 20000 * 128);
  float* out; cudaMalloc(&out, 132 * 8 * 256 * 4);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int kind = 0; kind < 2; ++kind) for (int rep = 0; rep < 2; ++rep) {
    cudaEventRecord(e0);
    if (kind == 0) thr<0><<<132 * 4, 256>>>(out, 4096, 7); else thr<1><<<132 * 4, 256>>>(out, 4096, 7);
    cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1);
    double n = 132.0 * 4 * 8 * 4096 * 4;
    printf("%s: %.3f ms, %.1f Tmma/s, %.1f TFLOP/s\n", kind == 0 ? "e4m3 m16n8k32" : "f16 m16n8k16", ms, n / ms / 1e9, n * 16 * 8 * (kind == 0 ? 32 : 16) * 2 / ms / 1e9);
  }
  printf("err: %s\n", cudaGetErrorString(cudaGetLastError()));
}
