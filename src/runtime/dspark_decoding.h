// DSpark speculative decoding (spec ../shared/spec/dspark.md §6 - §10) as a
// DecodingStrategy (runtime/generate.h): each next() drafts a block at the anchor with
// the model's own draft stages (model/dspark.h), chooses how many drafts to verify (k),
// verifies the anchor and k drafts in ONE Engine::step (1 + k rows, the taps of every
// row come back with it), accepts a prefix of j drafts plus the correction / bonus
// token, rolls the session back over the rejected rows and writes the taps of the
// committed rows (anchor, d_1 .. d_j) into the drafter's rings.
//
// Lossless:
//   - temperature 0: a draft is accepted iff it equals the target's greedy pick of the
//     row before it (§8.2); the output is the target's greedy chain whatever was drafted
//     (the engine's verify rows compute what one-row steps compute: engine.h).
//   - temperature > 0: exact speculative sampling (§8.3): draft d ~ q is accepted with
//     probability min(1, p(d) / q(d)); on the first rejection the token is drawn from
//     normalise(max(0, p - q)) (p itself when that has no mass); after k acceptances the
//     bonus is drawn from the last row's p. p is exactly plain sampling's distribution
//     (sampling_distribution: Sampler::sample's temperature, top-k and top-p), q the
//     same transform of the drafter's Markov logits (§8.5). With deterministic drafts
//     (DSparkOptions::sampled_drafts false, or a draft hook) q is a point mass (§8.4):
//     accept with probability p(d), else draw from p without d.
//   - k depends only on what is known before each draft is drawn (§6.1): the schedule
//     scans the confidences c_1, c_2, .. (c_i is computed from the drafts before d_i)
//     and stops at the first one that fails; a static K ignores them.
// Randomness (§8.6), one std::mt19937_64 seeded by SamplerOptions::seed at start(), in
// this order per cycle: with sampled drafts one uniform per drafted row (rows 0 .. kmax
// - 1), then k acceptance uniforms, then one for the correction / bonus. Outputs equal
// plain sampling in distribution, not sample for sample.
//
// The drafter's state lives in a DSparkContext (the rings and the token ids of the
// positions they stand for), which a server keeps next to its Session across requests.
// prefill() keeps the longest prefix the context and the new prompt share; positions the
// session reuses but the context has no taps of (a prefix restored from a checkpoint,
// a snapshot or another strategy's run) are holes in the rings: still lossless (the
// drafts are only proposals), only acceptance drops until the window (W positions)
// refills. prefill() never asks taps for a whole prompt: it syncs the session to the
// prompt without its last W rows, then feeds those with taps, in chunks.
//
// Thread safety: as the engine (one thread at a time).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "model/dspark.h"
#include "runtime/engine.h"
#include "runtime/generate.h"
#include "runtime/sampler.h"

namespace dsx {

// ---- the sampler's distribution and the acceptance rule (pure functions) ----------------

// Plain sampling's distribution over ids 0 .. V-1 (Sampler::sample's, sampler.h): the
// weights of sample_weights() at temperature T, top_k (the first top_k by larger logit,
// then smaller id), top_p (the shortest such prefix reaching top_p of the mass), each id
// kept with weight / (the kept weights' sum). Temperature <= 1e-30, or a row without a
// finite maximum: one-hot on argmax (as Sampler::sample). p gets V values summing to 1.
// Throws dsx::Error on a non-finite temperature or top_p outside (0, 1].
void sampling_distribution(const float* logits, int64_t V, const SamplerOptions& o, double* p);

// The id whose cumulative mass (in id order) first exceeds u * sum(w) (u in [0, 1); w
// non-negative; the last id of positive weight if rounding leaves none). -1 when w has
// no positive weight.
int32_t sample_from(const double* w, int64_t V, double u);

// One verify row at temperature > 0 (§8.3 / §8.4): target distribution p, draft
// distribution q (null: a point mass on d), draft d, two uniforms in [0, 1). Returns
// true (d accepted) when u_accept * q(d) < p(d) (q(d) = 1 for a point mass); else false
// with *token drawn by u_draw from normalise(max(0, p - q)) (for a point mass: p
// without d), or from p when that has no mass (§8.3).
bool speculative_row(const double* p, const double* q, int32_t d, int64_t V, double u_accept, double u_draw,
                     int32_t* token);

// A whole block (§8.3 steps 1-3): p has k + 1 rows [k + 1, V] (row r: the target's
// distribution of the token after the anchor and d_1 .. d_r), q k rows [k, V] (null:
// point masses), drafts d_1 .. d_k, u k + 1 uniforms (u[r] decides d_{r+1}, u[k] draws
// the correction or the bonus). The tokens emitted: d_1 .. d_j and the correction /
// bonus; accepted = j.
struct SpeculativeResult {
  int accepted = 0;
  std::vector<int32_t> tokens;
};
SpeculativeResult speculative_block(const double* p, const double* q, const int32_t* drafts, int k, int64_t V,
                                    const double* u);

// ---- choosing k (§6) ------------------------------------------------------------------

// The verify length rule. Inputs: the confidence logits of the block's rows (row i - 1's
// sigmoid c_i estimates P(d_i accepted | d_1 .. d_{i-1} accepted), computed from the
// drafts before d_i only), the survivals A_i = c_1 .. c_i, and a cost table.
//   static_k >= 0: k = static_k (the --dspark static K), confidences ignored.
//   else, scanning i = 1, 2, .. and stopping at the first failure (non-anticipating):
//     (a) the prefix threshold (§6.2 rule 2): c_i >= threshold;
//     (b) the cost rule (§6.2 rule 4): the expected tokens per unit of time
//         (1 + A_1 + .. + A_i) / (draft_cost + C(1 + i)) must exceed that of i - 1;
//         C(N) = verify_cost[N - 1], the time of a verify step of N rows in units of one
//         plain step (verify_cost[0] = 1), draft_cost the drafter pass in the same units.
//   k is at most max_k.
// The default table is a placeholder for the H200 (one weight stream for all rows: a
// verify of 6 rows at 1.3 plain steps, the target) until bench measures it.
struct DSparkSchedule {
  int static_k = -1;
  float threshold = 0.0f;
  double draft_cost = 0.15;
  std::vector<double> verify_cost = {1.0, 1.06, 1.12, 1.18, 1.24, 1.30};  // N = 1 .. 6 rows
  // C(N); beyond the table: extrapolated with its last step.
  double cost(int rows) const;
  // "draft D; verify 1-N rows: C(1) .. C(N)"
  std::string describe() const;
};

// The cost table measured on an engine and a drafter (the schedule's C(N) and draft
// cost; rule (b) above): a scratch session fed a random prompt of `context` tokens with
// taps, then per row count N = 1 .. B + 1 (at most the rollback depth) the median wall
// time of `iters` verify-shaped steps (the taps and the greedy pick of every row, rolled
// back) after two warm-up steps (CUDA: the eager run, then the graph's capture), and the
// median of `iters` drafter passes at that position with B - 1 committed rows pending
// (a cycle's shape); all in units of the one-row step. static_k and threshold come from
// base. Wall times vary between runs: k chosen from a measured table may differ between
// runs, which leaves greedy output unchanged and sampled output exact in distribution,
// but a seed then no longer fixes the sample (a table given as numbers does).
DSparkSchedule measure_schedule(Engine& eng, const Drafter& d, const DSparkSchedule& base = {}, int iters = 5,
                                int64_t context = 64);
// "D:C1,C2,...,CN" (draft cost, then C(1) .. C(N); C(1) = 1) -> the table, static_k and
// threshold from base. Throws dsx::Error naming the problem.
DSparkSchedule parse_schedule_costs(const std::string& v, const DSparkSchedule& base = {});

// k for one block: conf_logits [n] (n = block rows drafted), at most max_k (<= n).
// survival (optional) gets A_1 .. A_n.
int choose_k(const DSparkSchedule& s, const float* conf_logits, int n, int max_k,
             std::vector<double>* survival = nullptr);

// ---- the drafter's state of one sequence ----------------------------------------------

// The drafter's rings (model/dspark.h DrafterState: host or device rings, as the
// drafter keeps them) and the token ids of the positions
// 0 .. end() - 1 they stand for (observed rows, or holes: positions committed without
// taps). Keep one next to each Session a server reuses across requests; it is valid as
// long as its tokens() are a prefix of the session's (prefill and next check).
class DSparkContext {
 public:
  // rollback_depth: how far truncate() can go back keeping the window whole (the ring
  // capacity is W + rollback_depth).
  explicit DSparkContext(const Drafter& d, int rollback_depth = 16);
  const DrafterState& state() const { return *st_; }
  const Drafter& drafter() const { return *d_; }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  int64_t end() const { return static_cast<int64_t>(tokens_.size()); }
  // Keeps positions below the common prefix of tokens() and ids[0..n), forgets the rest;
  // returns what it kept.
  int64_t keep_common_prefix(const int32_t* ids, int64_t n);
  void truncate(int64_t p);  // forgets positions >= p
  void reset() { truncate(0); }
  // Appends positions end() .. end() + T - 1: ids and their taps [T, tap_width]
  // (observe), or no taps (skip: holes).
  void observe(const int32_t* ids, const float* taps, int64_t T);
  void skip(const int32_t* ids, int64_t T);
  // To a committed sequence tokens[0..n) (a session's): keeps the common prefix, the
  // rest of the n positions become holes; returns the positions kept with their rows.
  // A context that already ends at n on the same last token is taken as in step (its
  // owner extends and truncates it with the session), without a scan: call it freely.
  // scan: compare the whole prefix anyway (after the session's state was replaced, e.g.
  // restored from disk, the context may hold another sequence of the same length).
  int64_t align(const int32_t* tokens, int64_t n, bool scan = false);
  // Ring rows an anchor at end() sees (W of them when there is no hole).
  int64_t context_rows() const { return st_->context_rows(end()); }
  int64_t bytes() const { return st_->bytes() + static_cast<int64_t>(tokens_.capacity()) * 4; }

 private:
  const Drafter* d_;
  std::unique_ptr<DrafterState> st_;
  std::vector<int32_t> tokens_;
};

// ---- the strategy ----------------------------------------------------------------------

struct DSparkOptions {
  DSparkSchedule schedule;
  // At temperature > 0: drafts sampled from q (the Markov walk feeds each sampled draft
  // to the next row) or the Markov argmax (q a point mass, §8.4). Temperature 0 drafts
  // greedily.
  bool sampled_drafts = true;
  // Rows per Engine::step when prefill feeds the prompt's last rows with taps.
  int64_t prefill_chunk = 64;
  // Tests (§13.1 draft override): called with the anchor position and the draft before k
  // is chosen; may replace tokens and confidence_logits. Drafts are then deterministic:
  // at temperature > 0 q is a point mass on them (lossless for any hook).
  std::function<void(int64_t n, DSparkDraft& d)> draft_hook;
};

struct DSparkStats {
  int64_t cycles = 0;          // next() calls
  int64_t drafted = 0;         // cycles that ran the drafter
  int64_t verified = 0;        // drafts sent to verification (sum of k)
  int64_t accepted = 0;        // drafts accepted (sum of j)
  int64_t verify_rows = 0;     // target rows next() fed (sum of 1 + k)
  int64_t tokens = 0;          // tokens next() returned (sum of j + 1)
  std::vector<int64_t> accepted_hist;  // cycles by j (0 .. block size)
  double draft_seconds = 0, verify_seconds = 0;
  // verify steps and their wall time by rows (index: 1 + k)
  std::vector<int64_t> verify_steps_by_rows;
  std::vector<double> verify_seconds_by_rows;
  double accepted_per_cycle() const { return cycles ? static_cast<double>(accepted) / cycles : 0.0; }
  double tokens_per_cycle() const { return cycles ? static_cast<double>(tokens) / cycles : 0.0; }
  double acceptance() const { return verified ? static_cast<double>(accepted) / verified : 0.0; }
  std::string summary() const;  // one line for --stats
};

// One sequence's cycle (draft, verify, accept) in three calls, so that a caller can
// verify the blocks of several sequences, and plain rows of others, in ONE Engine::step
// (the server's scheduler); DSparkDecoding::next is these three calls around a step of
// one feed. The one implementation of the drafting, the verify feed and the acceptance
// rule (with its randomness, above) of both.
//
//   start(sampling)          the sampling options of a sequence, the generator seeded.
//   draft(ctx, anchor, kmax) the block at the anchor, whose position is n = ctx.end()
//                            (the session's position: ctx aligned to it); k <= kmax
//                            drafts chosen by the schedule (none when kmax < 1 or n < 2,
//                            C3). rows() = anchor, d_1 .. d_k. Returns k.
//   verify_feed(s)           the Feed of rows() on s (at n): the taps of every row; the
//                            picks at T = 0, the logits of every row at T > 0, in which
//                            case the step needs Step::all_rows (needs_all_rows()).
//   accept(s, ctx, out)      after the step: the acceptance rule (T = 0: a draft is
//                            accepted iff it is the pick of the row before it; T > 0:
//                            speculative_block); s back to n + j + 1, the taps of the
//                            anchor and d_1 .. d_j observed into ctx; appends d_1 .. d_j
//                            and the correction / bonus token to out; returns j.
// A caller that keeps only a prefix t_1 .. t_m of the j + 1 tokens (a stop inside the
// block) rolls s back to n + m itself and truncates ctx to it.
class DSparkCycle {
 public:
  DSparkCycle(const Drafter& drafter, DSparkOptions o = {});
  void start(const SamplerOptions& sampling);
  // The most drafts a cycle may verify on an engine when at most `limit` tokens may be
  // committed: min(block size, limit - 1, the engine's rollback depth), at least 0.
  int max_drafts(const Engine& eng, int64_t limit) const;
  int draft(DSparkContext& ctx, int32_t anchor, int kmax);
  const std::vector<int32_t>& rows() const { return rows_; }
  int64_t anchor_position() const { return n_; }
  Feed verify_feed(Session& s);
  bool needs_all_rows() const { return sampling_on(); }
  int accept(Session& s, DSparkContext& ctx, std::vector<int32_t>& out);

  const Drafter& drafter() const { return d_; }
  const DSparkOptions& options() const { return o_; }
  DSparkOptions& options() { return o_; }
  const SamplerOptions& sampling() const { return sampling_; }
  // Accumulated over cycles (start() does not clear them).
  const DSparkStats& stats() const { return stats_; }
  void reset_stats();

 private:
  bool sampling_on() const { return !(sampling_.temperature <= 0.0f); }  // (NaN samples, and fails)
  const Drafter& d_;
  DSparkOptions o_;
  SamplerOptions sampling_;
  std::mt19937_64 rng_;
  DSparkStats stats_;
  int64_t n_ = 0;      // the anchor's position
  int k_ = 0;
  bool point_ = true;  // q a point mass on each draft (deterministic drafts)
  std::chrono::steady_clock::time_point verify_start_;
  // working buffers
  std::vector<int32_t> rows_, picks_;
  std::vector<float> logits_, taps_, row_;
  std::vector<double> p_, q_;
};

class DSparkDecoding final : public DecodingStrategy {
 public:
  // The drafter (and the context, when given) must outlive the strategy. Without a
  // context the strategy keeps its own (one sequence's).
  explicit DSparkDecoding(const Drafter& drafter, DSparkOptions o = {}, DSparkContext* ctx = nullptr);
  void start(const SamplerOptions& sampling) override;
  SyncResult prefill(Session& s, const int32_t* ids, int64_t n) override;
  void next(Session& s, int32_t anchor, int64_t limit, std::vector<int32_t>& out) override;

  // The context the next calls use (a server's per-session one); null: the own one.
  void set_context(DSparkContext* ctx);
  DSparkContext& context() { return *ctx_; }
  const DSparkOptions& options() const { return cycle_.options(); }
  DSparkOptions& options() { return cycle_.options(); }
  // Accumulated over calls (start() does not clear them).
  const DSparkStats& stats() const { return cycle_.stats(); }
  void reset_stats() { cycle_.reset_stats(); }

 private:
  void align(Session& s);  // the context to s.tokens()
  const Drafter& d_;
  DSparkCycle cycle_;
  std::unique_ptr<DSparkContext> own_;
  DSparkContext* ctx_ = nullptr;
  std::vector<float> taps_;  // (prefill)
};

// ---- which drafter computes for an engine -------------------------------------------------

// A drafter of a model directory for an engine of one backend (the backend's weights in
// the engine's precision: EngineOptions::precision). Registered per backend name, as
// the engines (runtime/engine.h): "cuda" by runtime/cuda_drafter.cpp in CUDA builds.
using DrafterFactory = std::function<std::unique_ptr<Drafter>(const std::string& model_dir, const Engine& eng)>;
void register_drafter_backend(const std::string& backend, DrafterFactory f);
// Whether a drafter is registered for the backend ("cpu" always is).
bool drafter_backend_available(const std::string& backend);
// The drafter of `backend` (default: the engine's backend) for eng; "cpu" is the CPU
// reference (DSparkDrafter). Throws dsx::Error for a model without stages or a backend
// without a drafter.
std::unique_ptr<Drafter> load_drafter(const std::string& model_dir, const Engine& eng, const std::string& backend = "");

}  // namespace dsx
