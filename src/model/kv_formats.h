// The compact forms of the cached values (spec model-v41.md §5.1) and exact host
// conversions between them and the f32 values the fake-quantizers produce. Every value
// is exactly code x scale, a bf16-representable number:
//
//  * FQ8   (window KV): e4m3 codes [rows, dim] + ue8m0 scales [rows, dim / 32].  dim + dim/32 B/row
//  * FQ4e4 (compressed KV rows): e2m1 nibble pairs [rows, dim / 2] (low nibble = even
//          element) + e4m3 scales [rows, dim / 16].                          dim/2 + dim/16 B/row
//  * FQ4e8 (index keys): e2m1 nibble pairs [rows, dim / 2] + ue8m0 scales [rows, dim / 32].
//
// pack_*: the inputs must be outputs of the matching fake-quantizer (any block of values
// code x scale); a block that no code/scale pair reproduces bit-exactly makes the function
// throw dsx::Error. The chosen scale is the one the quantizer itself would produce on these
// values whenever that one reproduces them.
#pragma once
#include <cstdint>

namespace dsx {

constexpr int64_t fq8_row_bytes(int dim) { return dim + dim / 32; }
constexpr int64_t fq4e4_row_bytes(int dim) { return dim / 2 + dim / 16; }
constexpr int64_t fq4e8_row_bytes(int dim) { return dim / 2 + dim / 32; }

void pack_fq8_rows(const float* vals, int64_t rows, int dim, uint8_t* codes, uint8_t* scales);
void unpack_fq8_rows(const uint8_t* codes, const uint8_t* scales, int64_t rows, int dim, float* out);
void pack_fq4e4_rows(const float* vals, int64_t rows, int dim, uint8_t* packed, uint8_t* scales);
void unpack_fq4e4_rows(const uint8_t* packed, const uint8_t* scales, int64_t rows, int dim, float* out);
void pack_fq4e8_rows(const float* vals, int64_t rows, int dim, uint8_t* packed, uint8_t* scales);
void unpack_fq4e8_rows(const uint8_t* packed, const uint8_t* scales, int64_t rows, int dim, float* out);

}  // namespace dsx
