// The CPU reference engine over an already built V4.1 model (tests that supply their
// own Engram token map, e.g. a golden case's recorded one). load_engine(dir, {"cpu"})
// builds the same engine from a model directory.
#pragma once
#include <memory>

#include "model/v41_cpu.h"
#include "runtime/engine.h"

namespace dsx {

std::unique_ptr<Engine> make_cpu_engine(std::unique_ptr<V41Cpu> model, const EngineOptions& opts = {});

}  // namespace dsx
