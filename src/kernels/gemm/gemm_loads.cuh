// The TMA loads of one K-block of each expert GEMM form, and each form's operand layout: shared
// by the standalone expert GEMM (expert_gemm.cu) and the persistent kernels, so a tile loads the
// same bytes whichever kernel runs it.
//
// Producer loads per K-block of 64 (tensor maps a0, a1, b0, b1; K-major boxes are
// [rows x 64 K], MN-major boxes [64 K-rows x 64 MN], four of them for a 256-wide B):
//   kGateUpSwiGLU, kGateUpStore  A rows (a0), B gate rows (b0) then up rows (b1), 128 each
//   kDownStore                   A = h rows (a0), B = Wd rows (b0), 256
//   kDownGrad                    A = d_out rows (a0), B = Wd MN-major (b0)
//   kGateUpGradStore             K < I: A = d_g (a0), B = Wg MN-major (b0); then d_u (a1), Wu (b1)
//   kWeightGrad                  A = [rows, M] MN-major (a0, two chunks), B = [rows, N] (b0)
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/common/ptx.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_mainloop.cuh"

namespace mok::kernels {

template <ExpertGemmForm kForm>
struct FormTraits {
  static constexpr bool kAMnMajor = kForm == ExpertGemmForm::kWeightGrad;
  static constexpr bool kBMnMajor = kForm == ExpertGemmForm::kDownGrad ||
                                    kForm == ExpertGemmForm::kGateUpGradStore ||
                                    kForm == ExpertGemmForm::kWeightGrad;
  static constexpr bool kRowTiles = kForm != ExpertGemmForm::kWeightGrad;
  static constexpr int kTileN = tile_n_columns(kForm);
};

// Issues the TMA loads of one K-block into a stage (the map above).
template <ExpertGemmForm kForm>
__device__ __forceinline__ void issue_loads(const CUtensorMap* a0, const CUtensorMap* a1,
                                            const CUtensorMap* b0, const CUtensorMap* b1,
                                            const ExpertGemmParams& params, const TileCoord& coord,
                                            int k_block, __nv_bfloat16* a_dst, __nv_bfloat16* b_dst,
                                            uint64_t* full) {
  constexpr int kChunk = 64 * BLOCK_K;  // elements of one [64 x 64] box
  const int k = k_block * BLOCK_K;
  const int row = coord.m_tile * BLOCK_M - params.macrobatch.ring_row_base;  // row-tile forms
  if constexpr (kForm == ExpertGemmForm::kGateUpSwiGLU || kForm == ExpertGemmForm::kGateUpStore) {
    ptx::tma_load_2d(a_dst, a0, full, k, row);
    ptx::tma_load_3d(b_dst, b0, full, k, coord.n_tile * 128, coord.expert);
    ptx::tma_load_3d(b_dst + 128 * BLOCK_K, b1, full, k, coord.n_tile * 128, coord.expert);
  } else if constexpr (kForm == ExpertGemmForm::kDownStore) {
    ptx::tma_load_2d(a_dst, a0, full, k, row);
    ptx::tma_load_3d(b_dst, b0, full, k, coord.n_tile * 256, coord.expert);
  } else if constexpr (kForm == ExpertGemmForm::kDownGrad) {
    ptx::tma_load_2d(a_dst, a0, full, k, row);
#pragma unroll
    for (int c = 0; c < 4; ++c)
      ptx::tma_load_3d(b_dst + c * kChunk, b0, full, coord.n_tile * 256 + c * 64, k, coord.expert);
  } else if constexpr (kForm == ExpertGemmForm::kGateUpGradStore) {
    const bool first_half = k < params.k_extent;
    const int k_half = first_half ? k : k - params.k_extent;
    ptx::tma_load_2d(a_dst, first_half ? a0 : a1, full, k_half, row);
#pragma unroll
    for (int c = 0; c < 4; ++c)
      ptx::tma_load_3d(b_dst + c * kChunk, first_half ? b0 : b1, full, coord.n_tile * 256 + c * 64,
                       k_half, coord.expert);
  } else {
    const int k_row = coord.k_row0 + k;
#pragma unroll
    for (int c = 0; c < 2; ++c)
      ptx::tma_load_2d(a_dst + c * kChunk, a0, full, coord.m_tile * 128 + c * 64, k_row);
#pragma unroll
    for (int c = 0; c < 4; ++c)
      ptx::tma_load_2d(b_dst + c * kChunk, b0, full, coord.n_tile * 256 + c * 64, k_row);
  }
}

}  // namespace mok::kernels
