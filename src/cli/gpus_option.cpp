#include "cli/gpus_option.h"

#include <cstdio>
#include <cstdlib>

#include "model/placement.h"
#include "util/error.h"

namespace dsx::cli {

const char* const kGpusHelp =
    "  --gpus N            expert parallelism over N ranks (default 1). cpu: the N ranks' MoE math in\n"
    "                      one process (same results as 1, up to the order of the final sums); cuda:\n"
    "                      only 1 (multi-GPU CUDA execution is not built yet). `dsx model plan` shows\n"
    "                      the placement\n";

void apply_gpus_option(const Args& a, EngineOptions& o) {
  if (!a.has("--gpus")) return;
  const std::string v = a.require("--gpus");
  char* end = nullptr;
  const long n = std::strtol(v.c_str(), &end, 10);
  if (v.empty() || !end || *end) fail("--gpus: '", v, "' is not a number of GPUs");
  if (n < 1) fail("--gpus: ", n, " GPUs; the count must be at least 1");
  if (n > 1 << 16) fail("--gpus: ", n, " GPUs is not a plausible count");
  o.expert_ranks = static_cast<int>(n);
}

void print_placement_at_load(const Engine& e, const EngineOptions& o) {
  if (o.expert_ranks <= 1 || e.config().family != Family::V41) return;
  PlacementOptions po;
  if (o.max_context > 0) po.context = o.max_context;
  std::fprintf(stderr, "%s", format_placement(plan_placement(e.config(), o.expert_ranks, po), "the loaded model").c_str());
}

}  // namespace dsx::cli
