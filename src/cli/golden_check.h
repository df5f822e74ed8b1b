// Golden-case comparison (../shared/golden README §6): per path, the number of
// leading rows whose row-wise relative L2 error is at most 1e-3 and the largest
// error on them; greedy tokens; and, on the CPU, the decisions (experts, top-k,
// candidate blocks) that changed at the first divergent row.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/engine.h"

namespace dsx {

struct PathAgreement {
  int64_t rows = 0;
  int64_t leading = 0;    // leading rows with rel-L2 <= 1e-3
  double max_err = 0;     // largest rel-L2 on those rows
  int64_t required = 0;   // what the acceptance rule asks for
  bool ok() const { return leading >= required; }
};

struct GoldenReport {
  std::string case_name;
  int64_t T = 0, T0 = 0, N = 0;
  PathAgreement prefill, incremental;
  int64_t argmax_prefill = 0;        // rows whose prefill argmax equals the golden's
  int64_t argmax_incremental = 0;
  int64_t greedy_match = 0;          // leading greedy tokens equal to the golden ones
  bool greedy_required = false;      // prefill agrees on every row -> first 8 must match
  bool greedy_ok = true;
  std::string divergence_note;       // what changed at the first divergent prefill row (CPU)
  bool ok() const { return prefill.ok() && incremental.ok() && greedy_ok; }
  std::string summary() const;
};

// Whether a golden case directory holds a V4.1 case (config model_type deepseek_v41).
bool is_v41_golden_case(const std::string& dir);
// Whether a golden case directory holds a V4 case (config model_type deepseek_v4).
bool is_v4_golden_case(const std::string& dir);

// Runs both paths and the greedy continuation of a golden case on `engine`.
// With explain=true (CPU only) re-runs the prefill capturing decisions to
// describe the first divergence.
GoldenReport check_golden_case(const std::string& case_dir, Engine& engine, bool explain);

// Prefill logits of a golden case's prompt on `engine` ([T, vocab]).
std::vector<float> golden_prefill_logits(const std::string& case_dir, Engine& engine);

double row_rel_l2(const float* a, const float* b, int64_t n);

}  // namespace dsx
