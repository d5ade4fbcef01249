// The CPU reference's FP8 block-scaled GEMM operands (MoeConfig::precision = kFP8Block): each
// operand is quantized exactly as the GPU quantizes it (mok/fp8.h: e4m3 values, one fp32 scale
// per 128 values along the reduction, 128 x 128 blocks for weights) and handed to the fp32 GEMMs
// dequantized (q * scale). The GPU sums q products per 128-long block on its tensor cores and
// scales the block's sum once; the two agree up to fp32 rounding, so the layer is checked
// against this reference at the bf16 tolerance while the quantization itself is bit-exact.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/dtype.h"
#include "mok/fp8.h"
#include "mok/shape.h"
#include "thread_pool.h"

namespace mok::reference::detail {

// Throws mok::Error(kInvalidArgument) naming the field unless H, I and Is are multiples of 128
// (the FP8 groups and blocks).
void check_fp8_shape(const char* call, const MoeShape& shape);

// `values` [rows, cols] row-major (both multiples of 128) quantized in 128 x 128 blocks,
// dequantized to fp32 into `out`.
void fp8_block_weights(ThreadPool& pool, const bf16* values, int64_t rows, int64_t cols,
                       float* out);

// Pre-quantized `codes` [rows, cols] with one scale per 128 x 128 block (`scales` [rows/128,
// cols/128]) dequantized into `out`: e4m3_to_float(code) * scale, the value the GPU's GEMMs use.
void fp8_dequantize_blocks(ThreadPool& pool, const e4m3* codes, const float* scales, int64_t rows,
                           int64_t cols, float* out);

// Quantizes and dequantizes each row of `values` [rows, cols] (row stride `ld`) in place, in
// groups of 128 from the row's start; the last group may be shorter (as a tile padded with zero
// rows, which move no amax).
void fp8_rows_in_place(ThreadPool& pool, float* values, int64_t rows, int64_t cols, int64_t ld);

}  // namespace mok::reference::detail
