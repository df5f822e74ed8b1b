// The DeepSeek V4.1 Flash release configuration (spec model-v41.md §1.2, every released
// key), for what is computed from the configuration alone when no release checkpoint is
// at hand: the multi-GPU placement plan (`dsx model plan --release`, model/placement.h).
#pragma once
#include "model/config.h"

namespace dsx {

// The release's config.json (40 backbone layers, 384 experts top-6, Engram on layers 1
// and 14, 3 DSpark stages), parsed by parse_model_config like a file on disk.
ModelConfig release_v41_flash_config();

}  // namespace dsx
