// `dsx bench --dspark`: DSpark speculative decoding against plain decoding on one engine
// (cmd_bench.cpp). A model directory: code prompts and agent-style prompts (chat
// rendered, tools for the agent ones), greedy (T = 0), each generated plain and with
// DSpark: the outputs compared id for id, tokens/s of both, accepted drafts and tokens per
// cycle, the draft cost per cycle and the verify cost by rows. --synthetic: the costs
// alone at the release shapes (random stage weights: the drafts are noise).
#pragma once
#include <string>

#include "model/dspark.h"
#include "runtime/engine.h"

namespace dsx::cli {

struct DSparkBenchOptions {
  int64_t tokens = 512;    // generated per prompt
  int prompts = 0;         // per category (0: all of them)
  std::string categories = "code,agent";
  int iters = 20;          // synthetic: timed repetitions
  std::string costs = "default";  // the schedule's table: default | measure | D:C1,..
};

// Returns the process exit status: 0, or 1 when a DSpark output differs from plain.
int bench_dspark_model(Engine& eng, const std::string& model_dir, const DSparkBenchOptions& o);
int bench_dspark_synthetic(Engine& eng, Drafter& drafter, const DSparkBenchOptions& o);

}  // namespace dsx::cli
