// One-token MoE decode as two one-wave streaming launches (the building blocks of
// gemv_stream_device.cuh; semantics of moe.h):
//
//  up:   the rows of w1 and w3 of the routed experts (MXFP4) and of the shared expert
//        (FP8) against QA8(x), written as raw f32 sums gu[slot][w1|w3][I]. Blocks are
//        divided between the two formats in proportion to their steps; each block
//        streams a contiguous range of rows, evenly divided among its warps (rows split
//        between warps are added in warp order). The shared expert's blocks issue their
//        first loads before the grid dependency wait; the routed ones need the router's
//        expert ids first.
//  down: block b owns output rows [n0, n1) of D and streams, for each of them, row n of
//        w2 of every slot (routed MXFP4, shared FP8), so the slot outputs of a row meet
//        in the block and are added in the reference order (ascending expert id, shared
//        expert last) without atomics. Each block first forms h = QA8(w_j silu(g) u)
//        of every slot from gu (clamp, and the bf16 rounding points in BF16 mode) and
//        stages it; block 0 also writes h to the workspace (moe.h contract). Its first
//        w2 loads are issued before the grid dependency wait: the expert ids were final
//        before the up kernel let this one launch (every up block waits for the router
//        before it triggers its dependents).
#include <algorithm>
#include <cmath>

#include "kernels/cuda/gemv_launch.h"
#include "kernels/cuda/gemv_stream_device.cuh"
#include "kernels/cuda/moe_device.cuh"
#include "kernels/cuda/moe_stream.h"
#include "util/error.h"

namespace dsx::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kU = 16;     // steps in flight per lane
constexpr int kMaxS = 16;  // slots (topk + shared)

// ---------------------------------------------------------------------------------
// up

struct UpParams {
  const uint8_t* const* w1;
  const uint8_t* const* w1s;
  const uint8_t* const* w3;
  const uint8_t* const* w3s;
  dev::WView sw1, sw3;
  int D, I, topk;
  const int32_t* ids;
  const void* x;
  int xt;
  int qblock;
  float* gu;  // [S][2][I]
  int nb_sh;  // blocks of the shared expert (the first ones)
  int cpr_mx, spr_mx, cpr_fp, spr_fp;
};

// Matrix `mat` of a part: routed mat = 2 j + m (m: 0 = w1, 1 = w3); shared mat = m.
__device__ __forceinline__ dev::WView up_view(const UpParams& p, bool shared, int mat) {
  if (shared) return mat == 0 ? p.sw1 : p.sw3;
  dev::WView v;
  const int e = p.ids[mat >> 1];
  v.w = (mat & 1) ? p.w3[e] : p.w1[e];
  v.s = (mat & 1) ? p.w3s[e] : p.w1s[e];
  v.row_bytes = p.D / 2;
  v.sc_cols = p.D / 32;
  v.wshift = 5;
  return v;
}

// Position in a part's step sequence: virtual row v = mat * I + r, step cs of the row.
struct UpCursor {
  int mat, r, cs;
  dev::WView view;
};

template <WFormat F>
__device__ __forceinline__ void up_part(const UpParams& p, bool shared, int64_t nrows, int nb, int b, float* smem_x,
                                        float (&part)[kWarps][2]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int cpr = shared ? p.cpr_fp : p.cpr_mx, spr = shared ? p.spr_fp : p.spr_mx;
  const int I = p.I;
  const int64_t r0 = static_cast<int64_t>(b) * nrows / nb, r1 = static_cast<int64_t>(b + 1) * nrows / nb;
  const int S = static_cast<int>(r1 - r0) * spr;
  const int s_lo = S * warp / kWarps, s_hi = S * (warp + 1) / kWarps;
  float* out = p.gu + (shared ? static_cast<int64_t>(p.topk) * 2 * I : 0);

  const int64_t v_first = r0 + s_lo / spr;
  UpCursor ld{static_cast<int>(v_first / I), static_cast<int>(v_first % I), s_lo % spr, {}};
  auto next = [&](UpCursor& c, bool load_view) {
    if (++c.cs == spr) {
      c.cs = 0;
      if (++c.r == I) {
        c.r = 0;
        ++c.mat;
        if (load_view && c.mat < (shared ? 2 : 2 * p.topk)) c.view = up_view(p, shared, c.mat);
      }
    }
  };
  dev::Chunk ring[kU];
  auto prefetch = [&]() {
    if (s_lo < s_hi) ld.view = up_view(p, shared, ld.mat);
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      if (s_lo + u < s_hi) {
        dev::load_step<F>(ring[u], ld.view, cpr, ld.r, ld.cs, lane);
        next(ld, true);
      }
    }
  };
  if (shared) prefetch();  // weights only: before the wait
  dev::pdl_wait();
  if (!shared) prefetch();  // needs the expert ids
  dev::stage_rows(smem_x, 1, p.D, p.x, p.xt, p.D, 0, 1, 1, p.qblock, dev::kTrickPrescale);
  __syncthreads();
  dev::pdl_launch_dependents();

  const float4* xs4 = reinterpret_cast<const float4*>(smem_x);
  constexpr int EPC = dev::Fmt<F>::EPC;
  float acc[1] = {0.0f};
  UpCursor cu{static_cast<int>(v_first / I), static_cast<int>(v_first % I), s_lo % spr, {}};
  for (int s0 = s_lo; s0 < s_hi; s0 += kU) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int s = s0 + u;
      if (s < s_hi) {
        const int c = cu.cs * 32 + lane;
        if (c < cpr) dev::consume<F, 1>(ring[u], xs4, p.D / 4, c * EPC / 4, acc);
        if (s + kU < s_hi) {
          dev::load_step<F>(ring[u], ld.view, cpr, ld.r, ld.cs, lane);
          next(ld, true);
        }
        const int64_t v = static_cast<int64_t>(cu.mat) * I + cu.r;
        const int row_s0 = static_cast<int>(v - r0) * spr;
        const bool row_end = cu.cs + 1 == spr;
        next(cu, false);
        if (row_end || s + 1 == s_hi) {
          acc[0] = dev::warp_sum(acc[0]);
          if (lane == 0) {
            if (row_s0 >= s_lo && row_s0 + spr <= s_hi)
              out[v] = acc[0];
            else
              part[warp][v == v_first ? 0 : 1] = acc[0];
          }
          acc[0] = 0.0f;
        }
      }
    }
  }
  __syncthreads();
  if (s_lo < s_hi && lane == 0) {
    const int lr = (s_hi - 1) / spr;
    const int rs0 = lr * spr, rs1 = rs0 + spr;
    if (rs0 >= s_lo && rs1 > s_hi) {
      const int64_t v = r0 + lr;
      float sum = part[warp][v == v_first ? 0 : 1];
      for (int w = warp + 1; w < kWarps; ++w) {
        const int wlo = S * w / kWarps, whi = S * (w + 1) / kWarps;
        if (wlo >= rs1) break;
        if (whi > wlo) sum += part[w][0];
      }
      out[v] = sum;
    }
  }
}

__global__ void __launch_bounds__(kThreads, 2) moe_up_stream_kernel(const UpParams p) {
  extern __shared__ float4 smem_up[];
  __shared__ float part[kWarps][2];
  const int b = blockIdx.x;
  if (b < p.nb_sh) {
    up_part<WFormat::FP8_BLOCK>(p, true, 2LL * p.I, p.nb_sh, b, reinterpret_cast<float*>(smem_up), part);
  } else {
    up_part<WFormat::MXFP4>(p, false, 2LL * p.topk * p.I, static_cast<int>(gridDim.x) - p.nb_sh, b - p.nb_sh,
                            reinterpret_cast<float*>(smem_up), part);
  }
}

// ---------------------------------------------------------------------------------
// down

struct DownParams {
  const uint8_t* const* w2;
  const uint8_t* const* w2s;
  dev::WView sw2;
  int D, I, topk, S;  // S = topk + (shared ? 1 : 0)
  const int32_t* ids;
  const float* wts;
  const float* gu;  // [S][2][I]
  float lim;
  int qblock;
  int bf16;
  float* hq;  // [S][I] out (block 0)
  void* y;
  int yt;
  int cpr_mx, spr_mx, cpr_fp, spr_fp;
  int sn;  // steps per output row: topk * spr_mx + (shared ? spr_fp : 0)
};

struct DownCursor {
  int n, j, cs;
};

__global__ void __launch_bounds__(kThreads, 2) moe_down_stream_kernel(const DownParams p) {
  extern __shared__ float4 smem_dn[];
  float* xs = reinterpret_cast<float*>(smem_dn);           // [S][I] staged h
  float* res = xs + static_cast<int64_t>(p.S) * p.I;       // [n1 - n0][S] slot outputs
  __shared__ float part[kWarps][2];
  __shared__ const uint8_t* vw[kMaxS];
  __shared__ const uint8_t* vs[kMaxS];
  __shared__ int order[kMaxS];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int b = blockIdx.x, nb = gridDim.x;
  const int n0 = static_cast<int>(static_cast<int64_t>(b) * p.D / nb);
  const int n1 = static_cast<int>(static_cast<int64_t>(b + 1) * p.D / nb);
  const int S = (n1 - n0) * p.sn;
  const int s_lo = S * warp / kWarps, s_hi = S * (warp + 1) / kWarps;
  const int topk = p.topk, I = p.I;

  // expert pointers of the slots (see the file comment for why ids may be read here)
  if (threadIdx.x < p.S) {
    const int j = threadIdx.x;
    if (j < topk) {
      const int e = p.ids[j];
      vw[j] = p.w2[e];
      vs[j] = p.w2s[e];
    } else {
      vw[j] = p.sw2.w;
      vs[j] = p.sw2.s;
    }
  }
  if (threadIdx.x == 0) {  // slots by ascending expert id (insertion sort), shared last
    for (int j = 0; j < p.S; ++j) order[j] = j;
    for (int a = 1; a < topk; ++a) {
      const int v = order[a], ev = p.ids[v];
      int c = a - 1;
      while (c >= 0 && p.ids[order[c]] > ev) {
        order[c + 1] = order[c];
        --c;
      }
      order[c + 1] = v;
    }
  }
  __syncthreads();

  auto spr_of = [&](int j) { return j < topk ? p.spr_mx : p.spr_fp; };
  auto cursor_at = [&](int s) {
    DownCursor c;
    c.n = n0 + s / p.sn;
    const int q = s % p.sn;
    if (q < topk * p.spr_mx) {
      c.j = q / p.spr_mx;
      c.cs = q % p.spr_mx;
    } else {
      c.j = topk;
      c.cs = q - topk * p.spr_mx;
    }
    return c;
  };
  auto next = [&](DownCursor& c) {
    if (++c.cs == spr_of(c.j)) {
      c.cs = 0;
      if (++c.j == p.S) {
        c.j = 0;
        ++c.n;
      }
    }
  };
  auto load = [&](dev::Chunk& ch, const DownCursor& c) {
    dev::WView v;
    v.w = vw[c.j];
    v.s = vs[c.j];
    if (c.j < topk) {
      v.row_bytes = I / 2;
      v.sc_cols = I / 32;
      dev::load_step<WFormat::MXFP4>(ch, v, p.cpr_mx, c.n, c.cs, lane);
    } else {
      v.row_bytes = p.sw2.row_bytes;
      v.sc_cols = p.sw2.sc_cols;
      v.wshift = p.sw2.wshift;
      dev::load_step<WFormat::FP8_BLOCK>(ch, v, p.cpr_fp, c.n, c.cs, lane);
    }
  };

  dev::Chunk ring[kU];
  DownCursor ld = cursor_at(s_lo);
#pragma unroll
  for (int u = 0; u < kU; ++u) {
    if (s_lo + u < s_hi) {
      load(ring[u], ld);
      next(ld);
    }
  }
  dev::pdl_wait();

  // h of every slot, QA8'd, staged (swizzled, times the trick prescale); block 0
  // also writes the unscaled values to hq
  const int nqb = I / p.qblock, per = p.qblock / 32;
  for (int q = warp; q < p.S * nqb; q += kWarps) {
    const int j = q / nqb, blk = q % nqb;
    const float w = j < topk ? p.wts[j] : 1.0f;
    const float* g = p.gu + static_cast<int64_t>(j) * 2 * I;
    const float* u = g + I;
    float v[4];
    float m = 0.0f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k < per) {
        const int i = blk * p.qblock + lane + 32 * k;
        v[k] = dev::swiglu_h(__ldcg(g + i), __ldcg(u + i), w, p.lim, p.bf16);
        m = fmaxf(m, fabsf(v[k]));
      }
    }
    m = dev::warp_max(m);
    const float sc = dev::qa8_scale(m);
    float* row = xs + static_cast<int64_t>(j) * I;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if (k < per) {
        const int i = blk * p.qblock + lane + 32 * k;
        const float hv = e4m3_to_f32(dev::qa8_code(v[k], sc)) * sc;
        row[dev::swz(i >> 2) * 4 + (i & 3)] = hv * dev::kTrickPrescale;
        if (b == 0) p.hq[static_cast<int64_t>(j) * I + i] = hv;
      }
    }
  }
  __syncthreads();
  dev::pdl_launch_dependents();

  const float4* xs4 = reinterpret_cast<const float4*>(xs);
  const int xq = I / 4;
  float acc[1] = {0.0f};
  const DownCursor first = cursor_at(s_lo);
  DownCursor cu = first;
  for (int s0 = s_lo; s0 < s_hi; s0 += kU) {
#pragma unroll
    for (int u = 0; u < kU; ++u) {
      const int s = s0 + u;
      if (s < s_hi) {
        const int spr = spr_of(cu.j);
        if (cu.j < topk) {
          const int c = cu.cs * 32 + lane;
          if (c < p.cpr_mx) dev::consume<WFormat::MXFP4, 1>(ring[u], xs4 + cu.j * xq, xq, c * 8, acc);
        } else {
          const int c = cu.cs * 32 + lane;
          if (c < p.cpr_fp) dev::consume<WFormat::FP8_BLOCK, 1>(ring[u], xs4 + cu.j * xq, xq, c * 4, acc);
        }
        if (s + kU < s_hi) {
          load(ring[u], ld);
          next(ld);
        }
        const int row_s0 = s - cu.cs;
        const bool row_end = cu.cs + 1 == spr;
        const int n = cu.n, j = cu.j;
        next(cu);
        if (row_end || s + 1 == s_hi) {
          acc[0] = dev::warp_sum(acc[0]);
          if (lane == 0) {
            if (row_s0 >= s_lo && row_s0 + spr <= s_hi)
              res[(n - n0) * p.S + j] = acc[0];
            else
              part[warp][(n == first.n && j == first.j) ? 0 : 1] = acc[0];
          }
          acc[0] = 0.0f;
        }
      }
    }
  }
  __syncthreads();
  if (s_lo < s_hi && lane == 0) {
    const DownCursor c = cursor_at(s_hi - 1);
    const int rs0 = s_hi - 1 - c.cs, rs1 = rs0 + spr_of(c.j);
    if (rs0 >= s_lo && rs1 > s_hi) {
      float sum = part[warp][(c.n == first.n && c.j == first.j) ? 0 : 1];
      for (int w = warp + 1; w < kWarps; ++w) {
        const int wlo = S * w / kWarps, whi = S * (w + 1) / kWarps;
        if (wlo >= rs1) break;
        if (whi > wlo) sum += part[w][0];
      }
      res[(c.n - n0) * p.S + c.j] = sum;
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n1 - n0; i += kThreads) {
    float tot = 0.0f;
    for (int s = 0; s < p.S; ++s) {
      float v = res[i * p.S + order[s]];
      if (p.bf16) v = round_bf16(v);
      tot += v;
    }
    dev::store_act(p.y, p.yt, n0 + i, tot);
  }
}

int fp8_shift(int block) {
  int s = 0;
  while ((1 << s) < block) ++s;
  return s;
}

}  // namespace

bool moe_stream_enabled() {
  static const bool v = env_int("DSX_MOE_STREAM", 0) != 0;  // opt-in (see docs/gpu.md)
  return v;
}

size_t moe_stream_gu_floats(const MoeLayer& m, int topk) {
  const int S = topk + (m.shared_w1.data ? 1 : 0);
  return static_cast<size_t>(S) * 2 * m.inter;
}

bool moe_decode_stream(const MoeLayer& m, DType xt, const void* x, int64_t ldx, int T, int topk,
                       const int32_t* ids, const float* weights, DType yt, void* y, int64_t ldy, float* hq, float* gu,
                       cudaStream_t stream) {
  (void)ldx;
  (void)ldy;
  if (!moe_stream_enabled() || T != 1) return false;
  const bool has_shared = m.shared_w1.data != nullptr;
  const int S = topk + (has_shared ? 1 : 0);
  if (S > kMaxS) return false;
  const int D = static_cast<int>(m.hidden), I = static_cast<int>(m.inter);
  if (D % 32 || I % 32 || I % m.qblock) return false;
  if (has_shared && (m.shared_w1.block < 16 || m.shared_w2.block < 16)) return false;
  const int sms = sm_count();

  UpParams up{};
  up.w1 = m.w1;
  up.w1s = m.w1_scale;
  up.w3 = m.w3;
  up.w3s = m.w3_scale;
  auto fp8v = [](const QMatrix& W) {
    dev::WView v;
    v.w = W.data;
    v.s = W.scale;
    v.row_bytes = W.cols;
    v.sc_cols = static_cast<int>((W.cols + W.block - 1) / W.block);
    v.wshift = fp8_shift(static_cast<int>(W.block));
    return v;
  };
  if (has_shared) {
    up.sw1 = fp8v(m.shared_w1);
    up.sw3 = fp8v(m.shared_w3);
  }
  up.D = D;
  up.I = I;
  up.topk = topk;
  up.ids = ids;
  up.x = x;
  up.xt = static_cast<int>(xt);
  up.qblock = m.qblock;
  up.gu = gu;
  up.cpr_mx = D / 32;  // MXFP4: 32 elements per 16-byte chunk
  up.spr_mx = (up.cpr_mx + 31) / 32;
  up.cpr_fp = D / 16;
  up.spr_fp = (up.cpr_fp + 31) / 32;
  {
    const size_t smem = static_cast<size_t>(D) * 4;
    if (smem > detail::max_dynamic_smem(moe_up_stream_kernel)) return false;
    const int occ = detail::occupancy(moe_up_stream_kernel, kThreads, smem);
    const int64_t rows_mx = 2LL * topk * I, rows_sh = has_shared ? 2LL * I : 0;
    const double steps_mx = static_cast<double>(rows_mx) * up.spr_mx, steps_sh = static_cast<double>(rows_sh) * up.spr_fp;
    int64_t blocks = std::min<int64_t>(static_cast<int64_t>(occ) * sms, rows_mx + rows_sh);
    int64_t nb_sh = has_shared ? std::llround(blocks * steps_sh / (steps_sh + steps_mx)) : 0;
    nb_sh = std::clamp<int64_t>(nb_sh, has_shared ? 1 : 0, std::min<int64_t>(rows_sh, blocks - 1));
    blocks = std::min(blocks, nb_sh + rows_mx);
    up.nb_sh = static_cast<int>(nb_sh);
    detail::launch_pdl(moe_up_stream_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream, up);
  }

  DownParams dn{};
  dn.w2 = m.w2;
  dn.w2s = m.w2_scale;
  if (has_shared) dn.sw2 = fp8v(m.shared_w2);
  dn.D = D;
  dn.I = I;
  dn.topk = topk;
  dn.S = S;
  dn.ids = ids;
  dn.wts = weights;
  dn.gu = gu;
  dn.lim = m.swiglu_limit;
  dn.qblock = m.qblock;
  dn.bf16 = yt == DType::BF16 ? 1 : 0;
  dn.hq = hq;
  dn.y = y;
  dn.yt = static_cast<int>(yt);
  dn.cpr_mx = I / 32;
  dn.spr_mx = (dn.cpr_mx + 31) / 32;
  dn.cpr_fp = I / 16;
  dn.spr_fp = (dn.cpr_fp + 31) / 32;
  dn.sn = topk * dn.spr_mx + (has_shared ? dn.spr_fp : 0);
  {
    const size_t base = static_cast<size_t>(S) * I * 4;
    // (n1 - n0) <= ceil(D / blocks) rows of S results
    int64_t blocks = std::min<int64_t>(4LL * sms, D);
    size_t smem = 0;
    for (int it = 0; it < 3; ++it) {
      smem = base + static_cast<size_t>((D + blocks - 1) / blocks) * S * 4;
      if (smem > detail::max_dynamic_smem(moe_down_stream_kernel)) return false;
      const int occ = detail::occupancy(moe_down_stream_kernel, kThreads, smem);
      const int64_t nb = std::min<int64_t>(static_cast<int64_t>(occ) * sms, D);
      if (nb >= blocks) break;
      blocks = nb;
    }
    smem = base + static_cast<size_t>((D + blocks - 1) / blocks) * S * 4;
    detail::launch_pdl(moe_down_stream_kernel, dim3(static_cast<unsigned>(blocks)), dim3(kThreads), smem, stream, dn);
  }
  return true;
}

}  // namespace dsx::cuda
