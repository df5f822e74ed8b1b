#include "kernels/cuda/compressor.h"

#include "kernels/cuda/cuda_util.h"
#include "kernels/cuda/elementwise.h"
#include "kernels/cuda/elementwise_dev.cuh"
#include "kernels/cuda/pdl_device.cuh"  // (trace marks)
#include "util/error.h"

namespace dsx::cuda {

using namespace dev;

namespace {

// One block per possibly-emitted group, one thread per latent channel.
template <typename T>
__global__ void compressor_kernel(int Tn, int r, int hd, int idx, int np, float eps, const float* __restrict__ kv,
                                  const float* __restrict__ gate, const T* __restrict__ kv_act,
                                  const float* __restrict__ ring_kv, const float* __restrict__ ring_gate, int pcap,
                                  const float* __restrict__ norm, const float* __restrict__ inv_freq,
                                  const uint16_t* __restrict__ wk, const float* __restrict__ k_norm,
                                  uint8_t* __restrict__ row_packed, uint8_t* __restrict__ row_scales,
                                  uint8_t* __restrict__ key_packed, uint8_t* __restrict__ key_scales,
                                  T* __restrict__ latents_out, const int64_t* __restrict__ d_pos) {
  extern __shared__ float sm[];  // lat[hd], k[idx]
  __shared__ double red[32];
  float* lat_s = sm;
  float* k_s = sm + hd;
  dev::trace_mark(72);
  const int64_t p0 = *d_pos;
  const int64_t j = p0 / r + blockIdx.x;
  if ((j + 1) * r > p0 + Tn) return;  // uniform: the group is not complete in this chunk
  const int d = threadIdx.x;
  const int lane = d & 31, warp = d >> 5, nw = blockDim.x >> 5;

  // ---- pooled projection z (f32), rounded to act
  float z;
  if (r == 1) {
    z = ld(kv_act, (j - p0) * hd + d);
  } else {
    auto gate_at = [&](int64_t pos) {
      return pos >= p0 ? gate[(pos - p0) * hd + d] : ring_gate[(pos % pcap) * hd + d];
    };
    auto kv_at = [&](int64_t pos) { return pos >= p0 ? kv[(pos - p0) * hd + d] : ring_kv[(pos % pcap) * hd + d]; };
    float mx = -INFINITY;
    for (int m = 0; m < r; ++m) mx = fmaxf(mx, gate_at(j * r + m));
    float den = 0.0f;
    for (int m = 0; m < r; ++m) den += expf(gate_at(j * r + m) - mx);
    float acc = 0.0f;
    for (int m = 0; m < r; ++m) acc = fmaf(kv_at(j * r + m), expf(gate_at(j * r + m) - mx) / den, acc);
    z = acc;
  }
  z = rnd<T>(z);

  // ---- latent = RMSNorm(z; norm)
  const double ss = block_sum(static_cast<double>(z) * static_cast<double>(z), red);
  const float rr = 1.0f / sqrtf(static_cast<float>(ss / static_cast<double>(hd)) + eps);
  const float lat = rnd<T>(norm[d] * (z * rr));
  if (latents_out) st(latents_out, static_cast<int64_t>(blockIdx.x) * hd + d, lat);
  lat_s[d] = lat;

  // ---- compressed row: RoPE at j*r, FQ4e4
  const float pos = static_cast<float>(j * r);
  {
    const float v = rnd<T>(rope_lane(lat, d, hd, np, pos, inv_freq, false));
    const QCode q = fq4e4_group(v);
    const uint8_t b = pack_nibbles(q.code);
    if ((d & 1) == 0) row_packed[(j * hd + d) / 2] = b;
    if ((d & 15) == 0) row_scales[j * (hd / 16) + d / 16] = f32_to_e4m3(q.scale);
  }
  __syncthreads();

  // ---- index key: LinBF(latent; wk) -> act
  for (int o = warp; o < idx; o += nw) {
    const uint16_t* wr = wk + static_cast<int64_t>(o) * hd;
    float acc = 0.0f;
    for (int i = lane; i < hd; i += 32) acc = fmaf(bf16_to_f32(wr[i]), lat_s[i], acc);
    acc = warp_sum(acc);
    if (lane == 0) k_s[o] = rnd<T>(acc);
  }
  __syncthreads();
  const float kv0 = d < idx ? k_s[d] : 0.0f;
  const double ss2 = block_sum(static_cast<double>(kv0) * static_cast<double>(kv0), red);
  const float rk = 1.0f / sqrtf(static_cast<float>(ss2 / static_cast<double>(idx)) + eps);
  float kn = d < idx ? rnd<T>(k_norm[d] * (kv0 * rk)) : 0.0f;
  kn = rnd<T>(rope_lane(kn, d, idx, np, pos, inv_freq, false));
  const QCode q = fq4e8_group(kn);
  const uint8_t b = pack_nibbles(q.code);
  if (d < idx) {
    if ((d & 1) == 0) key_packed[(j * idx + d) / 2] = b;
    if ((d & 31) == 0) key_scales[j * (idx / 32) + d / 32] = ue8m0_byte(q.scale);
  }
}

}  // namespace

int compressor_max_groups(int T, int ratio) { return ratio <= 1 ? T : T / ratio + 1; }

void compressor_emit(Act act, const CompressorArgs& a, cudaStream_t stream) {
  if (a.T <= 0) return;
  DSX_CHECK(a.ratio >= 1, "compressor_emit: ratio must be >= 1");
  DSX_CHECK(a.head_dim % 32 == 0 && a.head_dim <= 1024 && a.idx_dim % 32 == 0 && a.idx_dim <= a.head_dim,
            "compressor_emit: bad geometry");
  DSX_CHECK(a.rows.dim == a.head_dim && a.keys.dim == a.idx_dim, "compressor_emit: cache widths differ");
  DSX_CHECK(a.ratio == 1 ? a.kv_act != nullptr : (a.kv && a.gate && a.proj_kv && a.proj_gate && a.proj_cap >= a.ratio),
            "compressor_emit: projections missing");
  const int groups = compressor_max_groups(a.T, a.ratio);
  const size_t smem = static_cast<size_t>(a.head_dim + a.idx_dim) * sizeof(float);
  DSX_DISPATCH_ACT(act, T,
                   compressor_kernel<T><<<groups, a.head_dim, smem, stream>>>(
                       a.T, a.ratio, a.head_dim, a.idx_dim, a.n_pairs, a.eps, a.kv, a.gate,
                       static_cast<const T*>(a.kv_act), a.proj_kv, a.proj_gate, a.proj_cap, a.norm, a.inv_freq, a.wk,
                       a.k_norm, a.rows.packed, a.rows.scales, a.keys.packed, a.keys.scales,
                       static_cast<T*>(a.latents), a.d_pos));
  check_launch("compressor_emit");
}

}  // namespace dsx::cuda
