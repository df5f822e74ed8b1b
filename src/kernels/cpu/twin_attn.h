// CPU twins of the non-GEMM CUDA kernels (src/kernels/cuda/{elementwise,hc,engram_gate,
// compressor,indexer,topk,attention}): each mirrors the corresponding lines of
// src/model/v41_cpu.cpp (same primitives: cpu::rmsnorm, cpu::rope_apply, cpu::dot, the
// fake-quantizers; explicit std::fma where the host compiler fuses V41Cpu's
// multiply-adds), plus the bf16 rounding points of spec §4.2 when `bf16` is set
// (values are f32 arrays holding what the act-typed device buffers hold).
//
// One deliberate difference from V41Cpu: RoPE cos/sin are computed as the CUDA kernels
// do (cos/sin of the f32 angle in double, rounded once) instead of RopeTable::angles'
// cosf/sinf, which can differ by one ulp; the angle itself (fl32(pos * inv_freq)) is the
// same.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace dsx::cpu::twin {

float rnd(bool bf16, float v);

// cos/sin of fl32(pos * inv_freq[i]) for every pair.
void rope_angles(const float* inv_freq, int n_pairs, int64_t pos, float* cos_out, float* sin_out);

// y = RMSNorm(x; w) per row, rounded (x, y may alias).
void rmsnorm_rows(bool bf16, const float* x, float* y, const float* w, int rows, int n, float eps);

// In-place RoPE of every head of x [rows, heads, hd], row r at position p0 + r, rounded.
void rope_rows(bool bf16, float* x, int rows, int heads, int hd, int n_pairs, const float* inv_freq, int64_t p0,
               bool inverse);

// Indexer queries: RoPE (rounded) then FQ4e8, per head. out may alias in.
void rope_fq4e8(bool bf16, const float* in, float* out, int rows, int heads, int hd, int n_pairs,
                const float* inv_freq, int64_t p0);

// Window KV rows: FQ8(RoPE(RMSNorm(kv; w))) with roundings after norm and RoPE.
void kv_finish(bool bf16, const float* kv, const float* w, float eps, int rows, int hd, int n_pairs,
               const float* inv_freq, int64_t p0, float* out);

// ---- hyper-connections (M = 4), X [T, 4, D] --------------------------------------------
// V41Cpu::hc_mix: pre [T,4], post [T,4], comb [T,16] from fn [24, 4D], base [24], scale [3].
void hc_mix(const float* X, int T, int64_t D, const float* fn, const float* base, const float* scale, float eps,
            float hc_eps, int iters, float* pre, float* post, float* comb);
// expand (in place on X) and collapse, rounded.
void hc_expand(bool bf16, float* X, const float* y, const float* post, const float* comb, int T, int64_t D);
void hc_collapse(bool bf16, const float* X, const float* pre, int T, int64_t D, float* out);

// ---- Engram ---------------------------------------------------------------------------
// Gated update of X [T, M, D] from yE [T, (M+1) D] and w [M, D] (V41Cpu::engram), rounded.
void engram_gate(bool bf16, int T, int M, int64_t D, const float* yE, float* X, const float* w, float eps);

// ---- compressor -------------------------------------------------------------------------
// Groups completed by the chunk p0 .. p0+T-1 (j from p0/r while (j+1) r <= p0+T).
// kv_at(pos) / gate_at(pos): f32 projections of absolute positions (ratio > 1), or
// kv_at(pos) = the ratio-1 projection (act values). Outputs per emitted group: the
// FQ4e4 compressed row [hd], the FQ4e8 index key [idx] and the pre-RoPE latent [hd].
struct CompressorTwinOut {
  int64_t first_group = 0;
  std::vector<float> rows, keys, latents;
};
using RowAt = std::function<const float*(int64_t pos)>;
CompressorTwinOut compressor(bool bf16, int ratio, int hd, int idx, int n_pairs, float eps, int64_t p0, int T,
                             const RowAt& kv_at, const RowAt& gate_at, const float* norm, const float* inv_freq,
                             const float* wk, const float* k_norm);

// ---- indexer ------------------------------------------------------------------------------
// Scores of queries t < T (position p0 + t) against keys [n_rows, hd] (FQ4e8 values).
// q [T, H, hd] FQ4e8 values, w [T, H] weights_proj output (act values). Without
// candidates: scores[t] has (p0+t+1)/ratio entries. With cand_blocks[t] (ascending
// block ids): entries i = slot * bs + offset of the listed blocks (-inf past n_t).
void indexer_scores(bool bf16, int T, int H, int hd, int ratio, int64_t p0, const float* q, const float* w,
                    const float* keys, const std::vector<std::vector<int32_t>>* cand_blocks, int cand_bs,
                    std::vector<std::vector<float>>& scores);
// Candidate block scores of one query (V41Cpu: max per block, newest pinned +inf).
std::vector<float> block_scores(const std::vector<float>& scores, int bs);
// V41Cpu's topk_finite: ascending ids of the min(k, #finite) largest, ties -> lower index.
std::vector<int32_t> topk_finite(const float* s, int64_t n, int64_t k);

// ---- attention ----------------------------------------------------------------------------
// V41Cpu::attention's inner loop for queries t < T (position p0 + t): window rows of
// positions max(0, p - W + 1) .. p from window_row(pos) ([hd] values), then the rows
// cmp_rows[sel[t][i]] ([hd] values); sink per head; output rounded; inverse RoPE of the
// output if inv_freq (rounded again). q [T, H, hd] (act values), out [T, H, hd].
void attention(bool bf16, int T, int H, int hd, int W, int64_t p0, const float* q, const RowAt& window_row,
               const float* cmp_rows, const std::vector<std::vector<int32_t>>* sel, const float* sink, float scale,
               int n_pairs, const float* inv_freq, float* out);

}  // namespace dsx::cpu::twin
