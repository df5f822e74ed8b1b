// The model's fake-quantizers (spec model-v41.md §3.0.3, §3.0.5; golden README §2a),
// applied in place to f32 rows. Each returns exactly code * scale, which is a
// bf16-representable value.
#pragma once
#include <cstdint>

namespace dsx::cpu {

// QA8: activation quantization before FP8 / FP4 weight matrices. Blocks of `block`
// consecutive elements: a = max(max|x|, 1e-4), s = pow2ceil(a * fl32(1/448)),
// x <- e4m3_rne(clamp(x / s, +-448)) * s. (FQ8 on the window KV is the same operator.)
void qa8_inplace(float* x, int64_t n, int block);

// The same quantization, returning e4m3 codes and one f32 scale per block.
void qa8_codes(const float* x, int64_t n, int block, uint8_t* codes, float* scales);

// FQ4e8: e2m1 values with power-of-two scales (indexer queries and keys, block 32):
// a = max(max|x|, 6 * 2^-126), s = pow2ceil(a * fl32(1/6)).
void fq4_e8_inplace(float* x, int64_t n, int block);

// FQ4e4: e2m1 values with e4m3 scales (compressed KV rows, block 16):
// a = max(max|x|, 6 * 2^-9), s = e4m3_rne(a / 6) (true division).
void fq4_e4_inplace(float* x, int64_t n, int block);

}  // namespace dsx::cpu
