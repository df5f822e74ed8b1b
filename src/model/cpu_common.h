// Pieces shared by the two CPU forward passes, V41Cpu (v41_cpu.cpp) and V4Cpu
// (v4_cpu.cpp), where both do the same thing: the chunk's setup and the head, the
// hyper-connection coefficients, collapse and expand, the window keys and the
// grouped output projection, the indexer's scores and top-k, the router and the
// experts. Internal to the CPU forwards (the kernels' CPU twin, kernels/cpu/twin_attn,
// reuses topk_finite and sinkhorn). What differs between the models stays in the
// model files, or is passed in from there explicitly.
//
// Arithmetic. The two forwards round differently on purpose: V41Cpu computes in f32
// and its multiply-adds are fused (the compiler contracts `a * b + c` in
// v41_cpu.cpp); V4Cpu is compiled without contraction and sums long reductions of
// f32 products in f64, to sit close to its golden (see v4_cpu.cpp). Every helper
// here either does no multiply-add at all (selection, copies, the Sinkhorn
// normalisation, the router, the SwiGLU) or takes the model's rounding as an
// explicit Arith; products and dot products are the model's own, passed in.
// cpu_common.cpp itself is compiled without contraction (fused means an explicit
// std::fma), so what it computes does not depend on the compiler's choices.
#pragma once
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "model/qmatrix.h"
#include "model/config.h"
#include "model/rope.h"
#include "model/kv_state.h"

namespace dsx {

struct ForwardDebug;  // model/v41_cpu.h

namespace fwd {

using Vec = std::vector<float>;

inline constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// How a forward rounds.
enum class Arith {
  kFusedF32,    // V4.1: f32 throughout; a * b + c is one fused multiply-add
  kUnfusedF64,  // V4: no fused multiply-adds; sums of f32 products in f64, rounded once
};

// The model's product y[t, n] = Σ_k x[t, k] W[n, k] (V4.1: kernels/cpu/linear; V4:
// its own f64-accumulated one), and the same restricted to weight rows [r0, r1).
using MatmulFn = void (*)(const float* x, int64_t T, const QMatrix& W, float* y);
using MatmulRowsFn = void (*)(const float* x, int64_t T, const QMatrix& W, int64_t r0, int64_t r1, float* y,
                              int64_t ldy);

// ---- the chunk -------------------------------------------------------------------------
// Per-forward values every layer reads (a model's Step adds its own).
struct StepBase {
  int64_t T = 0, p0 = 0;
  const int32_t* ids = nullptr;
  ForwardDebug* dbg = nullptr;
  // RoPE angles of the chunk's positions, [T, n_pairs]
  Vec cos_main, sin_main, cos_comp, sin_comp;

  const float* cos(bool comp, int64_t t, int np) const { return (comp ? cos_comp : cos_main).data() + t * np; }
  const float* sin(bool comp, int64_t t, int np) const { return (comp ? sin_comp : sin_main).data() + t * np; }
};

// Checks the chunk's token ids, fills s for ids[0..T) at positions st.pos.. (both
// RoPE tables) and, when dbg is set, resets it with one entry per layer.
void begin_step(StepBase& s, const ModelConfig& cfg, const RopeTable& main_rope, const RopeTable& compress_rope,
                const KVState& st, const int32_t* ids, int64_t T, ForwardDebug* dbg);

// §3.1 X [T, M, D]: every stream starts as the token's embedding.
Vec embed_streams(const QMatrix& embed, const int32_t* ids, int64_t T, int64_t M, int64_t D);

// §3.6 logits of the final rows h [T, D] (recorded in dbg): every row ([T, vocab])
// when all_rows, else the last one, none when logits is null; then the state moves past
// the chunk's tokens.
void end_step(KVState& st, const int32_t* ids, int64_t T, const Vec& h, int64_t D, const QMatrix& head, bool all_rows,
              float* logits, ForwardDebug* dbg, MatmulFn matmul);

// ---- hyper-connections (§3.3) ---------------------------------------------------------
// pre [T, M], post [T, M] and comb [T, M, M] (C[j * M + k], j = source stream) from z
// [T, (2 + M) M], the projection of the normalised streams: pre = σ(z·s0 + b) + ε,
// post = 2 σ(z·s1 + b), comb = sinkhorn(z·s2 + b); ε = hc_eps.
void hc_coefficients(const ModelConfig& cfg, const Vec& z, const Vec& base, const Vec& scale, int64_t T, Arith arith,
                     Vec& pre, Vec& post, Vec& comb);

// C [M, M] holds logits: every row becomes softmax + eps, then one column
// normalisation and iters - 1 rounds of row and column normalisation (x / (Σ + eps)).
void sinkhorn(float* C, int64_t M, float eps, int iters);

// The DSpark tap of every row (spec model-v41.md §1.5): out[t * ld + off + d] = the
// plain mean over the M streams X[t, m, d] (summed in stream order, divided by M, f32).
void stream_mean(const Vec& X, int64_t T, int64_t M, int64_t D, float* out, int64_t ld, int64_t off);

// y [T, D] = Σ_m pre_m · X_m; kFusedF32: a chain of FMAs from 0 in stream order;
// kUnfusedF64: the f32 products summed in f64, rounded once.
Vec hc_collapse(const Vec& X, const Vec& pre, int64_t T, int64_t M, int64_t D, Arith arith);
// X'_k = post_k · y + Σ_j C[j][k] · X_j (X [T, M, D] replaced); kFusedF32: the mix a
// chain of FMAs and post_k · y fused into the final add; kUnfusedF64: the mix summed
// in f64 (exact products) and rounded once, then post_k · y + mix in two roundings.
void hc_expand(Vec& X, const Vec& y, const Vec& post, const Vec& comb, int64_t T, int64_t M, int64_t D, Arith arith);

// ---- attention (§3.4) -----------------------------------------------------------------
// Window keys of the query at position p: rows of positions max(0, p - W + 1) .. p,
// the chunk's from kv [T, hd] (row 0 = position p0), older ones from the ring.
void window_keys(int64_t p, int64_t p0, int64_t W, const float* kv, int64_t hd, const WindowRing& ring,
                 std::vector<const float*>& keys);
// The chunk's window rows enter the ring (after every query of the chunk read it).
void push_window(WindowRing& ring, const Vec& kv, int64_t p0, int64_t T, int64_t hd);

// §3.4.8 grouped output projection without QA8: zeta [T, G * ol], group g = the
// heads' outputs o [T, H * hd] columns [g gw, (g + 1) gw) (gw = H hd / G) times wo_a
// rows [g ol, (g + 1) ol).
Vec grouped_output(const Vec& o, int64_t T, int64_t H, int64_t hd, int64_t G, int64_t ol, const QMatrix& wo_a,
                   MatmulRowsFn matmul_rows);

// The model's dot product (V4.1: kernels/cpu/linear; V4: f64-accumulated).
using DotFn = float (*)(const float* a, const float* b, int64_t n);
// §3.4.6 index scores of one query against the rows j < n_comp of keys [n_comp, ihd]:
// -inf for j >= n_vis, else Σ_h (relu(q_h · K_j) · scale) · w_h, for q [ih, ihd] and
// w [ih]; kFusedF32: the sum a chain of FMAs; kUnfusedF64: the f32 terms summed in f64.
void index_scores(const float* q, const float* w, const float* keys, int64_t n_comp, int64_t n_vis, int64_t ih,
                  int64_t ihd, float scale, Arith arith, DotFn dot, float* score);

// Indices of the k largest finite scores, ties broken by the lower index; returned
// in ascending index order.
std::vector<int32_t> topk_finite(const float* s, int64_t n, int64_t k);

// The selections of T queries as [T, topk] rows padded with -1 (for ForwardDebug).
void record_selection(std::vector<int32_t>& out, const std::vector<std::vector<int32_t>>& sel, int64_t T,
                      int64_t topk);

// ---- mixture of experts (§3.5) --------------------------------------------------------
// Router of T tokens from their gate logits [T, E]: scores s = sqrt(softplus(logit /
// gate_temp)); the experts of token t are hash[ids[t]] (a [vocab, K] table) when hash
// is given, else the K largest s + bias (ties: lower id, best first); their weights
// are their scores, divided by (Σ + 1e-20) when normalize, times routed_scaling.
// chosen, weight: [T, K].
void route(const ModelConfig& cfg, const Vec& logits, int64_t T, const float* bias, const int32_t* hash,
           const int32_t* ids, bool normalize, std::vector<int32_t>& chosen, Vec& weight);

// A layer's expert weights (routed experts by id, and the shared expert).
struct ExpertWeights {
  const std::vector<QMatrix>& w1;
  const std::vector<QMatrix>& w2;
  const std::vector<QMatrix>& w3;
  const QMatrix& sw1;
  const QMatrix& sw2;
  const QMatrix& sw3;
};
// The model's Lin8 / Lin4 of a down projection: g [n, W.cols] times W, for routed
// expert `expert` (-1: the shared expert); row i of g belongs to the chunk's token
// tok[i] (tok null: token i).
using DownProj =
    std::function<Vec(const Vec& g, int64_t n, const QMatrix& W, int64_t expert, const int64_t* tok)>;
// out [T, D] = the routed experts (ascending expert id, as the reference adds them)
// weighted by the router, plus the shared expert. fq [T, D] is the w1 / w3 input
// (already QA8'd, shared by all experts of a token); an expert's hidden is
// silu(min(g, lim)) · clamp(u, -lim, lim) (no clamps when swiglu_limit <= 0) with
// g = fq W1ᵀ, u = fq W3ᵀ, times the routing weight before its down projection.
void experts(const ModelConfig& cfg, const Vec& fq, int64_t T, const std::vector<int32_t>& chosen, const Vec& weight,
             const ExpertWeights& w, MatmulFn matmul, const DownProj& down, Vec& out);
// The two parts of experts(), also used by the expert-parallel ranks (model/cpu/expert_shards.h):
// out[tok[i]] += routed expert e's output for the chunk rows tok (ascending), weighted by
// wt[i]; and the shared expert's output [T, D].
void add_routed_expert(const ModelConfig& cfg, const Vec& fq, int64_t e, const std::vector<int64_t>& tok,
                       const Vec& wt, const ExpertWeights& w, MatmulFn matmul, const DownProj& down, Vec& out);
Vec shared_expert(const ModelConfig& cfg, const Vec& fq, int64_t T, const ExpertWeights& w, MatmulFn matmul,
                  const DownProj& down);

}  // namespace fwd
}  // namespace dsx
