// What the FP8 row-tile GEMMs (fp8_gemm.cu's 128-row tiles, fp8_gemm_192_rows.cu's 192-row
// ones) share: the K-block size, where each K-block's operands and B scale come from with
// fp8_gemm.h's splits, and the producer's arming of a free stage.
#pragma once

#include <cuda.h>

#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/gemm/fp8_gemm.h"
#include "mok/fp8.h"

namespace mok::kernels {

constexpr int kFp8TileN = 128;
constexpr int kFp8BlockK = 128;  // values (= bytes) per K-block: one swizzled 128-byte row
constexpr int kMaxTileKBlocks = static_cast<int>(kFp8MaxReduction / kFp8BlockK);

// Where a K-block of a kRowTiles tile comes from (the splits of fp8_gemm.h): A's and B's maps,
// the K offset inside them and B's scale.
struct Fp8Sources {
  const CUtensorMap* a;
  const CUtensorMap* a_scales;
  const CUtensorMap* b;
  int k_group;  // K-block inside the chosen part
  int b_n_tile;
};

__device__ __forceinline__ Fp8Sources row_tile_sources(const Fp8GemmMaps& maps,
                                                       const Fp8GemmParams& params, int n_tile,
                                                       int k_block) {
  Fp8Sources src{&maps.a, &maps.a_scales, &maps.b, k_block, n_tile};
  if (params.n_split > 0 && n_tile * kFp8TileN >= params.n_split) {
    src.b = &maps.b2;
    src.b_n_tile = n_tile - params.n_split / kFp8TileN;
  } else if (params.k_split > 0 && k_block * kFp8BlockK >= params.k_split) {
    src.a = &maps.a2;
    src.a_scales = &maps.a2_scales;
    src.b = &maps.b2;
    src.k_group = k_block - params.k_split / kFp8BlockK;
  }
  return src;
}

// B's scale of K-block `k_block` of a kRowTiles tile: [E, N_part / 128, K_part / 128] of its part.
__device__ __forceinline__ float row_tile_b_scale(const Fp8GemmParams& params, int expert,
                                                  int n_tile, int k_block) {
  const int num_k_blocks = params.k_extent / kFp8BlockK;
  if (params.n_split > 0) {
    const int split_tiles = params.n_split / kFp8TileN;
    const bool second = n_tile >= split_tiles;
    const int part_tiles = second ? params.n_extent / kFp8TileN - split_tiles : split_tiles;
    const int n = second ? n_tile - split_tiles : n_tile;
    return __ldg((second ? params.b2_scales : params.b_scales) +
                 (static_cast<int64_t>(expert) * part_tiles + n) * num_k_blocks + k_block);
  }
  const int n_tiles = params.n_extent / kFp8TileN;
  const int split_blocks = params.k_split > 0 ? params.k_split / kFp8BlockK : num_k_blocks;
  const bool second = k_block >= split_blocks;
  const int part_blocks = second ? num_k_blocks - split_blocks : split_blocks;
  return __ldg((second ? params.b2_scales : params.b_scales) +
               (static_cast<int64_t>(expert) * n_tiles + n_tile) * part_blocks +
               (second ? k_block - split_blocks : k_block));
}

// The producer waits for stage `stage` to be free (its consumers' arrivals on `empty`, in the
// ring's `phase`) and arms `full` for `bytes`; under the no-loads ablation for none, and then
// returns false: the caller issues no loads.
__device__ __forceinline__ bool arm_free_stage(const Fp8GemmParams& params, uint64_t* empty,
                                               uint64_t* full, uint32_t phase, uint32_t bytes) {
  mbarrier_wait(params.wait, WaitSite::kGemmFreeStage, empty, phase ^ 1);
  const bool load = params.ablation != GemmAblation::kNoLoads;
  ptx::mbarrier_arrive_expect_tx(full, load ? bytes : 0);
  return load;
}

}  // namespace mok::kernels
