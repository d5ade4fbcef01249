// The FP8 block-scaled grouped GEMM (fp8_gemm.cu; issue 17), shared by the host launcher and the
// kernel (plain data). For 128-row tiles of A that each belong to one expert (the schedule's):
//   out[row, n] = sum over K-blocks kb of 128 values of
//                 (sum_k A_q[row, k] * B_q[e, n, k]) * scale_a[kb][row] * scale_b[e][n/128][kb]
// with A_q, B_q e4m3 (both K-major: wgmma reads FP8 only that way), the scales fp32 in
// mok/fp8.h's recipe (1 x 128 groups of A along K, 128 x 128 blocks of B) and out bf16. This is
// the product the CPU reference computes from the dequantized operands, up to fp32 rounding.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <stdint.h>

#include "kernels/common/wait_types.h"
#include "mok/schedule.h"

namespace mok::kernels {

struct Fp8GemmMaps {
  CUtensorMap a;         // e4m3 [rows, K]: boxes [128 rows x 128], 128-byte swizzle
  CUtensorMap b;         // e4m3 [E, N, K]: boxes [1, 128 x 128], 128-byte swizzle
  CUtensorMap a_scales;  // fp32 [K / 128, rows] (group-major): boxes [1 x 128], no swizzle
  CUtensorMap out;       // bf16 [1, rows, N]: boxes [128 rows x 64] (the staging-tile epilogue)
  CUtensorMap out2;      // with n_split: columns [n_split, N) go here instead, at n - n_split
};

struct Fp8GemmParams {
  const ScheduleHeader* header;  // num_tiles: the 128-row tiles of A
  const int32_t* tile_expert;    // expert of each row tile
  const float* b_scales;         // [E, N / 128, K / 128]
  int32_t n_extent;              // N, a multiple of 128
  // 0, or a multiple of 128 below N: the output's columns from n_split on go to out2 (the
  // gate/up GEMM over [Wg; Wu] writes g and u to their own buffers).
  int32_t n_split;
  int32_t k_extent;  // K, a multiple of 128
  WaitContext wait;
};

// One persistent 384-thread CTA per SM at most (num_ctas). cudaErrorInvalidValue for N or K not
// multiples of 128.
cudaError_t launch_fp8_grouped_gemm(const Fp8GemmMaps& maps, const Fp8GemmParams& params,
                                    int num_ctas, cudaStream_t stream);

}  // namespace mok::kernels
