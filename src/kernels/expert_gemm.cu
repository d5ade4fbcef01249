// The expert grouped GEMM kernels (forward): gate/up with fused SwiGLU, and down with the
// scatter into per-(token, k) combine slots.
//
// Grid: persistent, one 384-thread CTA per SM (see gemm_mainloop.cuh for the warp roles).
// Tiles: (m, n) with m over the schedule's 128-row tiles (every tile inside one expert segment)
// and n over the output columns. Tile t maps to a group of kGroupM consecutive m-tiles (about
// one expert) swept n-major, so CTAs running together share B tiles of one expert and the A
// rows of the group in L2. CTA c takes tiles c, c + grid, c + 2*grid, ...: producer and
// consumers walk the same sequence, so no tile handoff is needed inside the CTA.
// Epilogues read the fp32 accumulators straight from registers:
//   kGateUpSwiGLU: register j (gate column) pairs with j + 16 (the up column 128 further), so
//                  SwiGLU is thread-local; h is stored as bf16 pairs.
//   kDownScatter:  each row goes to out + row_pair[row] * out_ld; padding rows are skipped.
#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/expert_gemm_params.h"
#include "kernels/gemm_mainloop.cuh"
#include "kernels/swiglu.cuh"

namespace mok::kernels {

namespace {

constexpr int kGroupM = 8;

struct TileCoord {
  int m_tile;
  int n_tile;
};

__device__ __forceinline__ TileCoord tile_coord(int tile, int num_m_tiles, int num_n_tiles) {
  const int group = tile / (kGroupM * num_n_tiles);
  const int first_m = group * kGroupM;
  const int group_m = min(kGroupM, num_m_tiles - first_m);
  const int local = tile - group * kGroupM * num_n_tiles;
  return {first_m + local % group_m, local / group_m};
}

template <ExpertGemmForm kForm>
__device__ __forceinline__ void epilogue(const ExpertGemmParams& params, const TileCoord& coord,
                                         int consumer_idx, const float (&acc)[128]) {
  constexpr int kTileN = tile_n_columns(kForm);
  const int row_base = coord.m_tile * BLOCK_M + consumer_idx * 64;
  const int col_base = coord.n_tile * kTileN;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row_base + fragment_row(i);
    __nv_bfloat16* out_row;
    if constexpr (kForm == ExpertGemmForm::kGateUpSwiGLU) {
      out_row = params.out + static_cast<int64_t>(row) * params.out_ld;
    } else {
      const int pair = params.row_pair[row];
      if (pair < 0) continue;
      out_row = params.out + static_cast<int64_t>(pair) * params.out_ld;
    }
    constexpr int kColumnGroups = kForm == ExpertGemmForm::kGateUpSwiGLU ? 16 : 32;
#pragma unroll
    for (int j = 0; j < kColumnGroups; ++j) {
      const int col = col_base + fragment_col(j);
      if (col >= params.n_extent) continue;
      float2 value;
      if constexpr (kForm == ExpertGemmForm::kGateUpSwiGLU) {
        value.x = swiglu_forward(acc[j * 4 + i * 2], acc[(j + 16) * 4 + i * 2], params.swiglu_limit);
        value.y = swiglu_forward(acc[j * 4 + i * 2 + 1], acc[(j + 16) * 4 + i * 2 + 1],
                                 params.swiglu_limit);
      } else {
        value.x = acc[j * 4 + i * 2];
        value.y = acc[j * 4 + i * 2 + 1];
      }
      *reinterpret_cast<__nv_bfloat162*>(out_row + col) = __float22bfloat162_rn(value);
    }
  }
}

template <ExpertGemmForm kForm>
__global__ void __launch_bounds__(kNumThreads, 1)
    expert_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,
                       const __grid_constant__ CUtensorMap tmap_b0,
                       const __grid_constant__ CUtensorMap tmap_b1, const ExpertGemmParams params) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  GemmSharedStorage& smem = *reinterpret_cast<GemmSharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  init_pipeline(smem);

  constexpr int kTileN = tile_n_columns(kForm);
  const int num_m_tiles = params.header->num_tiles;
  const int num_n_tiles = (params.n_extent + kTileN - 1) / kTileN;
  const int num_tiles = num_m_tiles * num_n_tiles;
  const int num_k_blocks = params.k_extent / BLOCK_K;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) {
      ptx::prefetch_tensor_map(&tmap_a);
      ptx::prefetch_tensor_map(&tmap_b0);
      if constexpr (kForm == ExpertGemmForm::kGateUpSwiGLU) ptx::prefetch_tensor_map(&tmap_b1);
      PipelineState state;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        const TileCoord coord = tile_coord(tile, num_m_tiles, num_n_tiles);
        const int expert = params.tile_expert[coord.m_tile];
        const int row = coord.m_tile * BLOCK_M;
        for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
          const int k = k_block * BLOCK_K;
          produce_stage(params.wait, smem, state, kTileABytes + kTileBBytes,
                        [&](__nv_bfloat16* a_dst, __nv_bfloat16* b_dst, uint64_t* full) {
                          ptx::tma_load_2d(a_dst, &tmap_a, full, k, row);
                          if constexpr (kForm == ExpertGemmForm::kGateUpSwiGLU) {
                            ptx::tma_load_3d(b_dst, &tmap_b0, full, k, coord.n_tile * 128, expert);
                            ptx::tma_load_3d(b_dst + 128 * BLOCK_K, &tmap_b1, full, k,
                                             coord.n_tile * 128, expert);
                          } else {
                            ptx::tma_load_3d(b_dst, &tmap_b0, full, k, coord.n_tile * 256, expert);
                          }
                        });
        }
      }
    }
  } else {
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    const int consumer_idx = warpgroup - 1;
    PipelineState state;
    float acc[128];
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      const TileCoord coord = tile_coord(tile, num_m_tiles, num_n_tiles);
      consume_tile(params.wait, smem, state, num_k_blocks, consumer_idx, acc);
      epilogue<kForm>(params, coord, consumer_idx, acc);
    }
  }
}

}  // namespace

size_t expert_gemm_smem_bytes() { return sizeof(GemmSharedStorage) + 1024; }

cudaError_t launch_expert_gemm(ExpertGemmForm form, const CUtensorMap& tmap_a,
                               const CUtensorMap& tmap_b0, const CUtensorMap& tmap_b1,
                               const ExpertGemmParams& params, int num_ctas, cudaStream_t stream) {
  const size_t smem_bytes = expert_gemm_smem_bytes();
  auto kernel = form == ExpertGemmForm::kGateUpSwiGLU
                    ? expert_gemm_kernel<ExpertGemmForm::kGateUpSwiGLU>
                    : expert_gemm_kernel<ExpertGemmForm::kDownScatter>;
  cudaError_t status =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem_bytes));
  if (status != cudaSuccess) return status;
  kernel<<<num_ctas, kNumThreads, smem_bytes, stream>>>(tmap_a, tmap_b0, tmap_b1, params);
  return cudaGetLastError();
}

}  // namespace mok::kernels
