// `--gpus N` of dsx run / serve / bench / generate / logits (issue 28, docs/multi-gpu.md):
// expert parallelism over N ranks. The CPU backend runs the N ranks' MoE math in one
// process (model/cpu/expert_shards.h); the CUDA backend has no multi-GPU execution yet and
// refuses N > 1. N = 1 (the default) is the one-device path.
#pragma once
#include <string>

#include "cli/registry.h"
#include "runtime/engine.h"

namespace dsx::cli {

// The help lines of the option (two-space indented, as the commands' usage texts).
extern const char* const kGpusHelp;

// Reads --gpus (1 when absent) into o.expert_ranks. Throws dsx::Error for a value < 1 or not
// a number (the engine refuses what its backend cannot run: CUDA, N > 1).
void apply_gpus_option(const Args& a, EngineOptions& o);

// With o.expert_ranks > 1: prints the placement plan of the loaded model to stderr.
void print_placement_at_load(const Engine& e, const EngineOptions& o);

}  // namespace dsx::cli
