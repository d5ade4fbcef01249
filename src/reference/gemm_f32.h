// The CPU reference's fixed-order fp32 dot product and the "NT" matrix product built on it,
// plus the conversions and transposes that put every operand into the NT form.
//
// The summation order is the contract of docs/design.md ("The reference's fixed summation
// order"): 8 fp32 lanes, each starting at +0; lane j adds a[i] * b[i] (product rounded to fp32,
// then added) for i = j, j+8, j+16, ... < n in increasing order; the result is
// ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)). gemm_nt produces every output element in exactly this
// order, whatever the blocking and the thread count.
#pragma once

#include <cstdint>

#include "mok/dtype.h"
#include "thread_pool.h"

namespace mok::reference {

inline constexpr int kDotLanes = 8;

// The fixed-order dot product of a[0, n) and b[0, n).
float dot_fixed(const float* a, const float* b, int64_t n);

// C[i * ldc + j] = dot_fixed(A + i * lda, B + j * ldb, depth) for i < rows, j < cols: both
// operands are depth-contiguous ("NT"). Parallel over output tiles.
void gemm_nt(ThreadPool& pool, int64_t rows, int64_t cols, int64_t depth, const float* a,
             int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc);
// The same with each result rounded once to bf16 (saves an fp32 copy of large outputs).
void gemm_nt(ThreadPool& pool, int64_t rows, int64_t cols, int64_t depth, const float* a,
             int64_t lda, const float* b, int64_t ldb, bf16* c, int64_t ldc);

// dst[i] = src[i] as fp32 for i < count.
void convert_bf16_to_float(ThreadPool& pool, const bf16* src, int64_t count, float* dst);

// dst[j * dst_ld + i] = src[i * src_ld + j] for i < rows, j < cols (bf16 or fp32 source).
void transpose_to_float(ThreadPool& pool, const bf16* src, int64_t rows, int64_t cols,
                        int64_t src_ld, float* dst, int64_t dst_ld);
void transpose_to_float(ThreadPool& pool, const float* src, int64_t rows, int64_t cols,
                        int64_t src_ld, float* dst, int64_t dst_ld);

}  // namespace mok::reference
