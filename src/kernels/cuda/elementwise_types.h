// Activation precision of the non-GEMM CUDA kernels. It is the same enum as the
// weight-streaming kernels' DType (kernels/cuda/quant_act.h), so one value selects
// the precision of a whole forward:
//
//  * Act::F32  - every activation is f32 and no intermediate rounding happens: the
//                semantics of the CPU engine (src/model/v41_cpu.cpp), which reproduces
//                the f32 golden cases.
//  * Act::BF16 - production: activations are stored as bf16 (RNE) at the rounding
//                points of spec model-v41.md §4.2, math in f32.
//
// Buffers typed `void*` / `const void*` in the launchers hold f32 or bf16 (uint16 bit
// pattern) elements according to the Act argument.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/cuda/quant_act.h"

namespace dsx::cuda {

using Act = DType;

inline constexpr size_t act_bytes(Act a) { return a == Act::F32 ? 4 : 2; }
inline constexpr const char* act_name(Act a) { return a == Act::F32 ? "f32" : "bf16"; }

}  // namespace dsx::cuda
