// The FP8 block-scaled grouped GEMM (fp8_gemm.h): DeepSeek-V3's recipe on Hopper's FP8 tensor
// cores, with the fp32 promotion at every 128-long K-block.
//
// Grid: persistent, one 384-thread CTA per SM; CTA c takes tiles c, c + grid, ... of 128 x 128
// outputs, grouped by row tiles (task_order.h's grouped_tile) so that running CTAs share B.
// Warp roles:
//   warpgroup 0   producer: one thread loads each K-block of 128 into a stage with TMA: the A
//                 tile [128 rows x 128] e4m3 (16 KB), the B tile [128 x 128] e4m3 (16 KB) and
//                 the A tile's 128 row scales (512 B), all completing on full[s]; it gives its
//                 registers away (setmaxnreg.dec).
//   warpgroups 1, 2  consumers: each owns 64 rows and two 64 x 128 fp32 register tiles. Per
//                 K-block: four wgmma m64n128k32 e4m3 into the fresh tile (scale-d 0 first),
//                 wait for them, read its rows' scales from the stage, release the stage
//                 (empty[s]), then add the tile into the running sum times scale_a * scale_b:
//                 Hopper's FP8 accumulation keeps too few bits for long sums, so no sum runs in
//                 the tensor core longer than one 128-long block. The K-block's scale_b is read
//                 from global memory before the stage is waited for.
// Pipeline: kFp8Stages stages of 32.5 KB (the 128-byte swizzle TMA writes and wgmma reads); the
// epilogue writes bf16 into a 32 KB staging tile and stores it with TMA (epilogue.cuh's helpers),
// overlapping the next tile's mainloop.
#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/fp8_gemm.h"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/persistent/task_order.h"

namespace mok::kernels {

namespace {

constexpr int kFp8TileN = 128;
constexpr int kFp8BlockK = 128;  // values (= bytes) per K-block: one swizzled 128-byte row
constexpr int kFp8Stages = 5;
constexpr int kFp8TileBytes = BLOCK_M * kFp8BlockK;  // A or B tile of one stage: 16 KB
constexpr int kFp8ScaleBytes = BLOCK_M * 4;

struct alignas(1024) Fp8SharedStorage {
  static constexpr int kNumStagesHere = kFp8Stages;
  uint8_t a[kFp8Stages][kFp8TileBytes];
  uint8_t b[kFp8Stages][kFp8TileBytes];
  __nv_bfloat16 store_tile[BLOCK_M * kFp8TileN];  // two [128 x 64] chunks (epilogue.cuh)
  float a_scales[kFp8Stages][BLOCK_M];
  uint64_t full[kFp8Stages];
  uint64_t empty[kFp8Stages];
};
static_assert(sizeof(Fp8SharedStorage) + 1024 <= 227 * 1024, "fits the SM's shared memory");

__global__ void __launch_bounds__(kNumThreads, 1) fp8_grouped_gemm_kernel(
    const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
    const __grid_constant__ CUtensorMap tmap_a_scales, const __grid_constant__ CUtensorMap tmap_out,
    const __grid_constant__ CUtensorMap tmap_out2, const Fp8GemmParams params) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Fp8SharedStorage& smem = *reinterpret_cast<Fp8SharedStorage*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  init_pipeline(smem);
  const int num_m_tiles = params.header->num_tiles;
  const int num_n_tiles = params.n_extent / kFp8TileN;
  const int num_k_blocks = params.k_extent / kFp8BlockK;
  const int num_tiles = num_m_tiles * num_n_tiles;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) {
      ptx::prefetch_tensor_map(&tmap_a);
      ptx::prefetch_tensor_map(&tmap_b);
      PipelineState<kFp8Stages> state;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
        int m_tile, n_tile;
        grouped_tile(tile, num_m_tiles, num_n_tiles, &m_tile, &n_tile);
        const int expert = params.tile_expert[m_tile];
        for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
          const int s = state.stage;
          mbarrier_wait(params.wait, WaitSite::kGemmFreeStage, &smem.empty[s], state.phase ^ 1);
          ptx::mbarrier_arrive_expect_tx(&smem.full[s], 2 * kFp8TileBytes + kFp8ScaleBytes);
          ptx::tma_load_2d(smem.a[s], &tmap_a, &smem.full[s], k_block * kFp8BlockK,
                           m_tile * BLOCK_M);
          ptx::tma_load_3d(smem.b[s], &tmap_b, &smem.full[s], k_block * kFp8BlockK,
                           n_tile * kFp8TileN, expert);
          ptx::tma_load_2d(smem.a_scales[s], &tmap_a_scales, &smem.full[s], m_tile * BLOCK_M,
                           k_block);
          state.advance();
        }
      }
    }
  } else {
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    const int consumer_idx = warpgroup - 1;
    const bool issuer = threadIdx.x == BLOCK_M;
    const int row0 = consumer_idx * 64 + fragment_row(0), row1 = row0 + 8;
    PipelineState<kFp8Stages> state;
    float block[64];  // one K-block's products (wgmma accumulator)
    float sum[64];    // the promoted fp32 sum
    for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x) {
      int m_tile, n_tile;
      grouped_tile(tile, num_m_tiles, num_n_tiles, &m_tile, &n_tile);
      const int expert = params.tile_expert[m_tile];
      const float* b_scales =
          params.b_scales + (static_cast<int64_t>(expert) * num_n_tiles + n_tile) * num_k_blocks;
      float scale_b = __ldg(b_scales);
      for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
        const int s = state.stage;
        const float next_scale_b = k_block + 1 < num_k_blocks ? __ldg(b_scales + k_block + 1) : 0;
        mbarrier_wait(params.wait, WaitSite::kGemmLoadedStage, &smem.full[s], state.phase);
        const uint64_t desc_a = ptx::smem_desc_k_major_sw128(smem.a[s] + consumer_idx * 64 * 128);
        const uint64_t desc_b = ptx::smem_desc_k_major_sw128(smem.b[s]);
        ptx::fence_registers(block);
        ptx::wgmma_fence();
#pragma unroll
        for (int k = 0; k < kFp8BlockK / 32; ++k)  // 32 bytes = 2 descriptor units per step
          ptx::wgmma_m64n128k32_e4m3(block, desc_a + 2 * k, desc_b + 2 * k, k > 0);
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();
        ptx::fence_registers(block);
        const float factor0 = smem.a_scales[s][row0] * scale_b;
        const float factor1 = smem.a_scales[s][row1] * scale_b;
        __syncwarp();  // every lane has read its scales before the stage is handed back
        if (threadIdx.x % 32 == 0) ptx::mbarrier_arrive(&smem.empty[s]);
        state.advance();
        // Fragment register j * 4 + i * 2 + c holds row row0 + 8 i (fragment_row).
#pragma unroll
        for (int r = 0; r < 64; ++r) {
          const float factor = (r / 2) % 2 == 0 ? factor0 : factor1;
          sum[r] = k_block == 0 ? block[r] * factor : fmaf(block[r], factor, sum[r]);
        }
        scale_b = next_scale_b;
      }
      acquire_staging_tile(issuer);
      char* staging = reinterpret_cast<char*>(smem.store_tile);
      stage_fragments<0, kFp8TileN / 8>(staging, consumer_idx, [&](int i, int j) {
        return make_float2(sum[j * 4 + i * 2], sum[j * 4 + i * 2 + 1]);
      });
      publish_staging_tile();
      if (issuer) {
        const int column = n_tile * kFp8TileN;
        const bool second = params.n_split > 0 && column >= params.n_split;
        store_chunks(second ? &tmap_out2 : &tmap_out, staging, 0, kFp8TileN / 64,
                     second ? column - params.n_split : column,
                     second ? params.n_extent - params.n_split
                            : (params.n_split > 0 ? params.n_split : params.n_extent),
                     m_tile * BLOCK_M, 0);
        ptx::bulk_commit_group();
      }
    }
    if (issuer) ptx::bulk_wait_group<0>();  // the last store reads the staging tile
  }
}

}  // namespace

cudaError_t launch_fp8_grouped_gemm(const Fp8GemmMaps& maps, const Fp8GemmParams& params,
                                    int num_ctas, cudaStream_t stream) {
  if (params.n_extent % kFp8TileN != 0 || params.k_extent % kFp8BlockK != 0 ||
      params.k_extent <= 0 || params.n_split < 0 || params.n_split % kFp8TileN != 0 ||
      params.n_split >= params.n_extent)
    return cudaErrorInvalidValue;
  const size_t smem_bytes = sizeof(Fp8SharedStorage) + 1024;
  cudaError_t status =
      cudaFuncSetAttribute(fp8_grouped_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem_bytes));
  if (status != cudaSuccess) return status;
  fp8_grouped_gemm_kernel<<<num_ctas, kNumThreads, smem_bytes, stream>>>(
      maps.a, maps.b, maps.a_scales, maps.out, maps.out2, params);
  return cudaGetLastError();
}

}  // namespace mok::kernels
