// The TMA loads of one K-block of each expert GEMM form, and each form's operand layout: shared
// by the standalone expert GEMM (expert_gemm.cu) and the persistent kernels, so a tile loads the
// same bytes whichever kernel runs it.
//
// Producer loads per K-block of 64 (tensor maps a0, a1, b0, b1; K-major boxes are
// [rows x 64 K], MN-major boxes [64 K-rows x 64 MN], four of them for a 256-wide B):
//   kGateUpSwiGLU, kGateUpStore  A rows (a0), B gate rows (b0) then up rows (b1), 128 each
//   kDownStore                   A = h rows (a0), B = Wd rows (b0), two boxes of 128
//   kDownGrad, kDownGradSwiGLU   A = d_out rows (a0), B = Wd MN-major (b0)
//   kGateUpGradStore             K < I: A = d_g (a0), B = Wg MN-major (b0); then d_u (a1), Wu (b1)
//   kWeightGrad                  A = [rows, M] MN-major (a0, two chunks), B = [rows, N] (b0)
// A CTA pair of the standalone kernel (expert_gemm.cu) whose two tiles read the same B loads
// half of B each and multicasts it to both CTAs (PairLoad): gate rows / up rows, the first /
// second 128 rows of Wd, or MN chunks 0-1 / 2-3. Each CTA's stage still receives A + B bytes.
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
  static constexpr bool kBMnMajor =
      kForm == ExpertGemmForm::kDownGrad || kForm == ExpertGemmForm::kDownGradSwiGLU ||
      kForm == ExpertGemmForm::kGateUpGradStore || kForm == ExpertGemmForm::kWeightGrad;
  static constexpr bool kRowTiles = kForm != ExpertGemmForm::kWeightGrad;
  static constexpr int kTileN = tile_n_columns(kForm);
};

// B of a K-block: all of it into this CTA (mask 0), or half `rank` multicast to the CTAs of
// `mask` (both of the pair).
struct PairLoad {
  uint16_t mask = 0;
  int rank = 0;
};

// One TMA box of B: local, or multicast along the pair.
__device__ __forceinline__ void load_b_3d(const PairLoad& pair, void* dst, const CUtensorMap* map,
                                          uint64_t* full, int inner, int middle, int outer) {
  if (pair.mask != 0)
    ptx::tma_load_3d_multicast(dst, map, full, inner, middle, outer, pair.mask);
  else
    ptx::tma_load_3d(dst, map, full, inner, middle, outer);
}
__device__ __forceinline__ void load_b_2d(const PairLoad& pair, void* dst, const CUtensorMap* map,
                                          uint64_t* full, int inner, int outer) {
  if (pair.mask != 0)
    ptx::tma_load_2d_multicast(dst, map, full, inner, outer, pair.mask);
  else
    ptx::tma_load_2d(dst, map, full, inner, outer);
}

// Issues the TMA loads of one K-block into a stage (the map above).
template <ExpertGemmForm kForm>
__device__ __forceinline__ void issue_loads(const CUtensorMap* a0, const CUtensorMap* a1,
                                            const CUtensorMap* b0, const CUtensorMap* b1,
                                            const ExpertGemmParams& params, const TileCoord& coord,
                                            int k_block, __nv_bfloat16* a_dst, __nv_bfloat16* b_dst,
                                            uint64_t* full, const PairLoad& pair = {}) {
  constexpr int kChunk = 64 * BLOCK_K;  // elements of one [64 x 64] box
  // The halves of B this CTA loads: both alone, or its own of the pair.
  const int first_half = pair.mask != 0 ? pair.rank : 0;
  const int end_half = pair.mask != 0 ? pair.rank + 1 : 2;
  const int k = k_block * BLOCK_K;
  const int row = coord.m_tile * BLOCK_M - params.macrobatch.ring_row_base;  // row-tile forms
  if constexpr (kForm == ExpertGemmForm::kGateUpSwiGLU || kForm == ExpertGemmForm::kGateUpStore) {
    ptx::tma_load_2d(a_dst, a0, full, k, row);
    for (int half = first_half; half < end_half; ++half)
      load_b_3d(pair, b_dst + half * 128 * BLOCK_K, half == 0 ? b0 : b1, full, k,
                coord.n_tile * 128, coord.expert);
  } else if constexpr (kForm == ExpertGemmForm::kDownStore) {
    ptx::tma_load_2d(a_dst, a0, full, k, row);
    for (int half = first_half; half < end_half; ++half)
      load_b_3d(pair, b_dst + half * 128 * BLOCK_K, b0, full, k, coord.n_tile * 256 + half * 128,
                coord.expert);
  } else if constexpr (kForm == ExpertGemmForm::kDownGrad ||
                       kForm == ExpertGemmForm::kDownGradSwiGLU) {
    ptx::tma_load_2d(a_dst, a0, full, k, row);
    for (int c = 2 * first_half; c < 2 * end_half; ++c)
      load_b_3d(pair, b_dst + c * kChunk, b0, full, coord.n_tile * 256 + c * 64, k, coord.expert);
  } else if constexpr (kForm == ExpertGemmForm::kGateUpGradStore) {
    const bool first_k_half = k < params.k_extent;
    const int k_half = first_k_half ? k : k - params.k_extent;
    ptx::tma_load_2d(a_dst, first_k_half ? a0 : a1, full, k_half, row);
    for (int c = 2 * first_half; c < 2 * end_half; ++c)
      load_b_3d(pair, b_dst + c * kChunk, first_k_half ? b0 : b1, full, coord.n_tile * 256 + c * 64,
                k_half, coord.expert);
  } else {
    const int k_row = coord.k_row0 + k;
#pragma unroll
    for (int c = 0; c < 2; ++c)
      ptx::tma_load_2d(a_dst + c * kChunk, a0, full, coord.m_tile * 128 + c * 64, k_row);
    for (int c = 2 * first_half; c < 2 * end_half; ++c)
      load_b_2d(pair, b_dst + c * kChunk, b0, full, coord.n_tile * 256 + c * 64, k_row);
  }
}

}  // namespace mok::kernels
