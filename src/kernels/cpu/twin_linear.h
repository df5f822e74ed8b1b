// CPU twins of the CUDA weight-streaming kernels (src/kernels/cuda/{gemv,gemm,moe,router}),
// with the same rounding points as the GPU kernels in both activation precisions:
//   round_bf16 == false: the f32 engine (V41Cpu) - nothing rounded;
//   round_bf16 == true:  BF16 mode (spec §4.2) - inputs are taken as given (callers
//                        pass bf16-exact values), every linear output is rounded once.
// They also return the magnitudes tests need for tolerances justified by the math:
// abs[t, n] = sum_k |x'[t, k] * W[n, k]| bounds the f32 summation-order error.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

#include "model/qmatrix.h"

namespace dsx::cpu::twin {

// Copy of the stored bytes of W with every sign bit cleared (|W| in the same format).
// The returned QMatrix points into `storage`.
QMatrix abs_matrix(const QMatrix& W, std::vector<uint8_t>& storage);

// y[t, g R + n] = sum_k x'[t, g Kg + k] * W[g R + n, k] (groups g; R = W.rows / groups,
// Kg = W.cols), x' = QA8(x) (blocks of qblock) when qa8 and W is FP8 / MXFP4.
// Output rounded to bf16 when round_bf16. abs (optional, [T, ldy]) gets sum |x' W|.
void linear(const float* x, int64_t T, int64_t ldx, const QMatrix& W, bool qa8, int qblock, int groups,
            bool round_bf16, float* y, int64_t ldy, float* abs = nullptr);

// The router of V41Cpu::moe on precomputed logits z [T, E]: ids / weights [T, topk]
// in selection order (descending biased score, ties -> lower id).
void router(const float* z, int64_t T, int64_t E, const float* bias, int topk, float gate_temp, bool norm_topk_prob,
            float route_scale, int32_t* ids, float* weights);

struct MoeTwinLayer {
  std::vector<QMatrix> w1, w3, w2;  // routed experts (MXFP4, host pointers)
  QMatrix sw1, sw3, sw2;            // shared expert (FP8); sw1.data == nullptr: none
  float swiglu_limit = 10.0f;
  int qblock = 32;
};

// MoE of V41Cpu::moe (routed experts in ascending id, then the shared expert) for
// tokens f [T, D] with given routing. BF16 mode rounds g, u, h, every y_e and the
// output to bf16. Optional outputs:
//   hq  [T][S][I]: QA8'd hidden vectors per slot (slot order as in ids, shared last),
//   mag [T, D]:    sum over experts of |y_e| (bf16 rounding tolerance),
//   abs [T, D]:    sum over experts of sum_k |h'_k W2[n, k]| (summation-order tolerance).
void moe(const float* f, int64_t T, int64_t D, int64_t I, int topk, const int32_t* ids, const float* weights,
         const MoeTwinLayer& m, bool round_bf16, float* out, std::vector<float>* hq = nullptr,
         std::vector<float>* mag = nullptr, std::vector<float>* abs = nullptr);

// Second half only: the down projections and the combine from given hidden vectors
// hq [T][S][I] (as produced by the GPU), same rounding and optional outputs.
void moe_down(const float* hq, int64_t T, int64_t D, int64_t I, int topk, const int32_t* ids, const MoeTwinLayer& m,
              bool round_bf16, float* out, std::vector<float>* mag = nullptr, std::vector<float>* abs = nullptr);

// ---- random test data ----------------------------------------------------------------

// A weight matrix owning its bytes (q points into data / scale; not copyable).
struct OwnedMatrix {
  QMatrix q;
  std::vector<uint8_t> data, scale;
  OwnedMatrix() = default;
  OwnedMatrix(const OwnedMatrix&) = delete;
  OwnedMatrix& operator=(const OwnedMatrix&) = delete;
  OwnedMatrix(OwnedMatrix&& o) noexcept;
  OwnedMatrix& operator=(OwnedMatrix&& o) noexcept;
};

struct RandomSpec {
  int scale_lo = -1, scale_hi = -1;  // e8m0 scale bytes (default per format: FP8 112..120, MXFP4 118..124)
  int e4m3_exp_lo = 0, e4m3_exp_hi = 15;  // FP8 codes: exponent field range (NaN codes never drawn)
  float sigma = 0.05f;                    // BF16 / F32: normal(0, sigma)
};

// Random matrix [N, K] in format fmt (FP8 tile `block`).
OwnedMatrix random_matrix(WFormat fmt, int64_t N, int64_t K, int block, std::mt19937_64& rng,
                          const RandomSpec& spec = {});

// Random activations [T, K]: normal values times 2^u per 32-block (u uniform in
// [exp_lo, exp_hi]); one block in ~16 all zero; rounded to bf16 when bf16_exact.
std::vector<float> random_acts(int64_t T, int64_t K, std::mt19937_64& rng, bool bf16_exact, int exp_lo = -8,
                               int exp_hi = 4);

}  // namespace dsx::cpu::twin
