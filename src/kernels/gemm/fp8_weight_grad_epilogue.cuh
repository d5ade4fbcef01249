// The FP8 weight gradients' epilogue in its output forms (fp8_gemm.h's Fp8WeightGradOut): a
// consumer warpgroup's fp32 sums into the kernel's staging tile as bf16 or fp32, written or
// added to the output's old values, which the storer thread loaded into the same staging tile
// with TMA before the consumers wait on it (fp8_gemm.cu). The plain bf16 form keeps
// epilogue.cuh's stage_fragments (its SASS unchanged).
//
// Staging layouts, both 128B-swizzled as TMA stores and loads them (16-byte unit u of a 128-byte
// row r at u ^ (r % 8)):
//   bf16  two chunks of [128 rows x 64 columns] (epilogue.cuh's): column pair j of a thread
//         (columns 8 j + 2 q, + 1; q = lane % 4) in chunk j / 8, 4 bytes at unit j % 8, + 4 q.
//   fp32  four chunks of [128 rows x 32 columns], 16 KB each: the pair in chunk j / 4, 8 bytes at
//         unit 2 (j % 4) + q / 2, + 8 (q % 2). A warp's 8 rows x 4 lanes write 256 bytes in two
//         shared-memory wavefronts, the fewest 8-byte stores can take.
// The sum is rounded once: round(old + sum) with old read as fp32 (a bf16 old value exactly).
#pragma once

#include <cuda_bf16.h>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/fp8_gemm.h"
#include "kernels/gemm/gemm_mainloop.cuh"

namespace mok::kernels {

constexpr bool fp8_weight_grad_is_f32(Fp8WeightGradOut out) {
  return out == Fp8WeightGradOut::kF32 || out == Fp8WeightGradOut::kF32Accumulate;
}
constexpr bool fp8_weight_grad_accumulates(Fp8WeightGradOut out) {
  return out == Fp8WeightGradOut::kBF16Accumulate || out == Fp8WeightGradOut::kF32Accumulate;
}
// Columns of one staging chunk (128-byte rows), and the chunks of a 128-column tile.
constexpr int fp8_weight_grad_chunk_columns(Fp8WeightGradOut out) {
  return fp8_weight_grad_is_f32(out) ? 32 : 64;
}
constexpr int fp8_weight_grad_chunks(Fp8WeightGradOut out) {
  return 128 / fp8_weight_grad_chunk_columns(out);
}
// The staging tile's bytes (the old values' TMA load completes this many on its barrier).
constexpr uint32_t fp8_weight_grad_staging_bytes(Fp8WeightGradOut out) {
  return static_cast<uint32_t>(fp8_weight_grad_chunks(out) * kStageChunkBytes);
}

// Where this thread's column pair j of tile row `row` lies in the staging tile (bytes).
template <Fp8WeightGradOut kOut>
__device__ __forceinline__ int weight_grad_pair_offset(int row, int j) {
  const int q = threadIdx.x % 4;
  if constexpr (fp8_weight_grad_is_f32(kOut))
    return (j / 4) * kStageChunkBytes + row * 128 + (((2 * (j % 4) + q / 2) ^ (row % 8)) << 4) +
           (q % 2) * 8;
  return (j / 8) * kStageChunkBytes + row * 128 + (((j % 8) ^ (row % 8)) << 4) + q * 4;
}

// Stages sum(i, j) (a float2: fragment row i, column pair j of this consumer warpgroup's 64 rows
// from row_base) for the 16 column pairs of a 128-column tile, in kOut's form.
template <Fp8WeightGradOut kOut, typename Sum>
__device__ __forceinline__ void stage_weight_grad_tile(char* staging, int row_base, Sum sum) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row_base + fragment_row(i);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      char* at = staging + weight_grad_pair_offset<kOut>(row, j);
      float2 value = sum(i, j);
      if constexpr (fp8_weight_grad_accumulates(kOut)) {
        float2 old;
        if constexpr (fp8_weight_grad_is_f32(kOut))
          old = *reinterpret_cast<const float2*>(at);
        else
          old = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(at));
        value = make_float2(old.x + value.x, old.y + value.y);
      }
      if constexpr (fp8_weight_grad_is_f32(kOut))
        *reinterpret_cast<float2*>(at) = value;
      else
        *reinterpret_cast<__nv_bfloat162*>(at) = __floats2bfloat162_rn(value.x, value.y);
    }
  }
}

// The storer: the staging tile's chunks to (or, load, from) out[expert] at tile (m_tile, n_tile).
template <Fp8WeightGradOut kOut>
__device__ __forceinline__ void store_weight_grad_tile(const CUtensorMap* out, const char* staging,
                                                       int m_tile, int n_tile, int expert) {
  constexpr int kColumns = fp8_weight_grad_chunk_columns(kOut);
#pragma unroll
  for (int c = 0; c < fp8_weight_grad_chunks(kOut); ++c)
    ptx::tma_store_3d(out, staging + c * kStageChunkBytes, n_tile * 128 + c * kColumns,
                      m_tile * BLOCK_M, expert);
}
template <Fp8WeightGradOut kOut>
__device__ __forceinline__ void load_weight_grad_tile(const CUtensorMap* out, char* staging,
                                                      uint64_t* loaded, int m_tile, int n_tile,
                                                      int expert) {
  constexpr int kColumns = fp8_weight_grad_chunk_columns(kOut);
  ptx::mbarrier_arrive_expect_tx(loaded, fp8_weight_grad_staging_bytes(kOut));
#pragma unroll
  for (int c = 0; c < fp8_weight_grad_chunks(kOut); ++c)
    ptx::tma_load_3d(staging + c * kStageChunkBytes, out, loaded, n_tile * 128 + c * kColumns,
                     m_tile * BLOCK_M, expert);
}

}  // namespace mok::kernels
