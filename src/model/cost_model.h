// What a decode step costs, from the configuration alone: the weight bytes a step reads
// and the state bytes at a context length (the roofline figures of `dsx bench`), and the
// release-shaped configuration of the synthetic benchmark model.
#pragma once
#include <cstdint>

#include "model/config.h"

namespace dsx {

// A V4.1 Flash configuration with the release's dimensions and `layers` backbone layers
// following the release schedule pattern (window, Engram, ratio-2 KV source and reuse,
// ratio-1 KV source / candidate source, re-index).
ModelConfig synthetic_v41_flash_config(int layers);

// Weight bytes one decode step must read (everything but the unselected experts; the
// head once; one embedding row; the Engram rows gathered).
int64_t v41_decode_weight_bytes(const ModelConfig& cfg);

// Bytes of session state a decode step at `context` tokens reads (window rows, selected
// compressed rows, index keys scored).
int64_t decode_state_bytes(const ModelConfig& cfg, int64_t context);

}  // namespace dsx
