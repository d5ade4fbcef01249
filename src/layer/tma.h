// Host-side creation of TMA tensor maps (CUtensorMap) for bf16 tensors, through the driver
// entry point that the CUDA runtime hands out (so mok does not link libcuda directly).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "mok/error.h"

namespace mok {

// A row-major bf16 matrix [outer, inner] read in boxes of [box_outer, box_inner] elements,
// swizzled by the box's row bytes: box_inner 64 (128 bytes) takes the 128-byte swizzle, 32 the
// 64-byte one, 16 the 32-byte one (each box row one swizzle span, as the kernels' shared-memory
// layouts assume); any other box_inner is an Error. `what` names the operand in errors.
CUtensorMap make_tensor_map_2d(const void* base, int64_t inner, int64_t outer, int32_t box_inner,
                               int32_t box_outer, const char* what);

// A bf16 tensor [batch, outer, inner], row-major within each batch entry, entries
// `batch_stride` elements apart (0: inner * outer, dense), read in boxes of
// [1, box_outer, box_inner], swizzled by box_inner as make_tensor_map_2d's.
CUtensorMap make_tensor_map_3d(const void* base, int64_t inner, int64_t outer, int64_t batch,
                               int32_t box_inner, int32_t box_outer, const char* what,
                               int64_t batch_stride = 0);

// Any element type and swizzle (the FP8 path: e4m3 operands with the 128-byte swizzle, fp32
// scales without): a row-major tensor of `rank` (1-3) dimensions, innermost first in `dims` and
// `box`, `strides_bytes` the byte strides of dimensions 1.. (rank - 1 of them).
// `promotion`: how much of the L2 line around each requested sector TMA fetches (every mok
// kernel uses 256 bytes; `mok stream-bench` measures the others).
enum class TmaElement { kBF16, kE4M3, kF32 };
enum class TmaL2Promotion { kNone, k128B, k256B };
CUtensorMap make_tensor_map(const void* base, TmaElement element, int rank, const int64_t* dims,
                            const int64_t* strides_bytes, const int32_t* box, bool swizzle_128b,
                            const char* what, TmaL2Promotion promotion = TmaL2Promotion::k256B);

}  // namespace mok
