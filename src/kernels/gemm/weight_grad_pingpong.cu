// The weight gradients with the two consumer warpgroups on different tiles ("ping-pong",
// MoeConfig::weight_grad_pingpong): out[e] [M, N] = A^T B over expert e's rows, as the kWeightGrad
// form of expert_gemm.cu computes it, with the epilogue of one tile under the other tile's
// mainloop.
//
// Why: a weight-gradient tile's K is its expert's rows, 2-16 K-blocks of 64 at the named shapes,
// so the epilogue (128 registers into the staging tile, the barriers, the TMA store) is a large
// fixed cost per tile; with both consumers on one tile the tensor cores idle through it
// (docs/perf.md: ~2.3 us per tile at `dsv3_local`, 16% of a tile there, most of one at `dsv3`).
//
// Warp roles of a 384-thread CTA:
//   warpgroup 0      producer: one thread issues the TMA loads of the CTA's tiles in walk order,
//                    every K-block into the next stage of one ring (A: 128 M x 64 K-rows, B: 128
//                    N x 64 K-rows, both MN-major, 32 KB a stage, kStages of them).
//   warpgroups 1, 2  consumers: consumer c owns the CTA's tiles c, c + 2, ... (of its walk), a
//                    128 x 128 fp32 tile each (two m64n128 halves, 128 registers per thread). It
//                    steps its ring position over the other consumer's K-blocks, waits for and
//                    releases only its own stages (their empty barriers count one consumer's
//                    four warps), and stores its tile through its own half of the staging memory
//                    with its own TMA bulk group, so one consumer's epilogue runs while the
//                    other's wgmmas keep the tensor cores busy. The two take turns at their
//                    mainloops (named barriers 4 and 5: a consumer starts tile i once the other
//                    has finished tile i - 1's wgmmas). Besides ordering the tensor-core work, the
//                    turns keep a consumer from waiting on a stage more than one lap ahead of the
//                    ring: it skipped the other's K-blocks, and a parity wait two laps ahead
//                    would pass on an old phase.
// Tiles: the kWeightGrad walk of tile_walk.h (expert by expert; within one, column tile by column
// tile, row tiles fastest) over 128 x 128 tiles. Each output element accumulates its expert's
// K-blocks in order with the same products as the 128 x 256 tiles of expert_gemm.cu: the same
// bits. One macrobatch only (no fp32 partials across macrobatches) and no CTA pairs: the launcher
// runs expert_gemm.cu's form otherwise.
#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/gemm/launch.h"
#include "kernels/gemm/tile_walk.h"
#include "kernels/gemm/weight_grad_segments.cuh"

namespace mok::kernels {

namespace {

constexpr int kTileM = 128;
constexpr int kTileN = 128;
constexpr int kStages = 4;
constexpr int kMnBox = 64 * BLOCK_K;                  // elements of one [64 K-rows x 64 MN] box
constexpr uint32_t kStageBytes = 2 * 2 * kMnBox * 2;  // A and B, two boxes each
constexpr int kWarpsPerConsumer = 4;

struct alignas(1024) PingPongStorage {
  __nv_bfloat16 a[kStages][kTileM * BLOCK_K];
  __nv_bfloat16 b[kStages][kTileN * BLOCK_K];
  // Consumer c's staging tile: two [128 rows x 64 columns] chunks (epilogue.cuh's layout).
  __nv_bfloat16 store_tile[2][kTileM * kTileN];
  uint64_t full[kStages];
  uint64_t empty[kStages];
};
static_assert(sizeof(PingPongStorage) + 1024 + kMaxSharedExperts * sizeof(SegmentRows) <=
                  227 * 1024,
              "the ring, the staging tiles and the segment rows fit the SM's shared memory");

struct PingPongTile {
  int expert;
  int m_tile;  // of 128 output rows
  int n_tile;  // of 128 output columns
  int k_row0;
  int num_k_blocks;
};

__device__ __forceinline__ PingPongTile tile_at(const ExpertGemmParams& params, int unit,
                                                int num_m_tiles, int num_n_tiles,
                                                const SegmentRows* shared_rows) {
  const WalkUnit walk = walk_unit(unit, num_m_tiles, num_n_tiles, /*row_tiles=*/false);
  const SegmentRows segment = segment_rows(params, shared_rows, walk.expert);
  return {walk.expert, walk.m_unit, walk.n_tile, segment.begin,
          (segment.end - segment.begin) / BLOCK_K};
}

// One consumer's tile: K-blocks of its own stages, two m64n128 halves (output rows 0-63 from A's
// first MN box, 64-127 from its second), each stage released once the wgmmas that read it are
// done (one wgmma group kept in flight, as consume_tile does).
template <typename State>
__device__ __forceinline__ void consume_pingpong_tile(const WaitContext& wait,
                                                      PingPongStorage& smem, State& state,
                                                      int num_k_blocks, float (&low)[64],
                                                      float (&high)[64]) {
  const bool releases = threadIdx.x % 32 == 0;
  if (num_k_blocks == 0) return;  // an expert without rows: the epilogue stores zeros
  int previous_stage = -1;
  for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
    mbarrier_wait(wait, WaitSite::kGemmLoadedStage, &smem.full[state.stage], state.phase);
    const uint64_t desc_low = ptx::smem_desc_mn_major_sw128(smem.a[state.stage], kMnChunkBytes);
    const uint64_t desc_high =
        ptx::smem_desc_mn_major_sw128(smem.a[state.stage] + kMnBox, kMnChunkBytes);
    const uint64_t desc_b = ptx::smem_desc_mn_major_sw128(smem.b[state.stage], kMnChunkBytes);
    ptx::fence_registers(low);
    ptx::fence_registers(high);
    ptx::wgmma_fence();
#pragma unroll
    for (int k = 0; k < BLOCK_K / 16; ++k) {
      const bool scale_d = k_block > 0 || k > 0;
      ptx::wgmma_m64n128k16_bf16<1, 1>(low, desc_low + k * k16_step<true>(),
                                       desc_b + k * k16_step<true>(), scale_d);
      ptx::wgmma_m64n128k16_bf16<1, 1>(high, desc_high + k * k16_step<true>(),
                                       desc_b + k * k16_step<true>(), scale_d);
    }
    ptx::wgmma_commit();
    ptx::fence_registers(low);
    ptx::fence_registers(high);
    ptx::wgmma_wait<1>();
    if (previous_stage >= 0 && releases) ptx::mbarrier_arrive(&smem.empty[previous_stage]);
    previous_stage = state.stage;
    state.advance();
  }
  ptx::wgmma_wait<0>();
  ptx::fence_registers(low);
  ptx::fence_registers(high);
  if (releases) ptx::mbarrier_arrive(&smem.empty[previous_stage]);
}

// Fragment (i, j) of a 64-register accumulator (gemm_mainloop.cuh's layout); zeros for an expert
// without rows, whose accumulator was never written.
__device__ __forceinline__ float2 fragment_pair(const float (&acc)[64], int i, int j, bool empty) {
  return empty ? make_float2(0.0f, 0.0f) : make_float2(acc[j * 4 + i * 2], acc[j * 4 + i * 2 + 1]);
}

// Consumer c's epilogue: bf16 of both halves into its staging tile, stored by its first thread.
// The staging tile is rewritten only after that thread's previous store has read it.
__device__ __forceinline__ void store_pingpong_tile(const CUtensorMap* out, PingPongStorage& smem,
                                                    const ExpertGemmParams& params,
                                                    const PingPongTile& tile, int consumer_idx,
                                                    const float (&low)[64],
                                                    const float (&high)[64]) {
  const bool issuer = threadIdx.x % 128 == 0;
  const int barrier_id = 2 + consumer_idx;  // 1 is epilogue.cuh's (not used in this kernel)
  char* staging = reinterpret_cast<char*>(smem.store_tile[consumer_idx]);
  if (issuer) ptx::bulk_wait_group_read<0>();
  ptx::named_barrier_sync(barrier_id, 128);
  const bool empty = tile.num_k_blocks == 0;
  stage_fragments<0, kTileN / 8>(staging, 0,
                                 [&](int i, int j) { return fragment_pair(low, i, j, empty); });
  stage_fragments<0, kTileN / 8>(staging, 64,
                                 [&](int i, int j) { return fragment_pair(high, i, j, empty); });
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(barrier_id, 128);
  if (issuer) {
    store_chunks(out, staging, 0, kTileN / 64, tile.n_tile * kTileN, params.n_extent,
                 tile.m_tile * kTileM, tile.expert);
    ptx::bulk_commit_group();
  }
}

__global__ void __launch_bounds__(kNumThreads, 1)
    weight_grad_pingpong_kernel(const __grid_constant__ CUtensorMap tmap_a,
                                const __grid_constant__ CUtensorMap tmap_b,
                                const __grid_constant__ CUtensorMap tmap_out,
                                const ExpertGemmParams params) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  PingPongStorage& smem = ptx::align_shared_1024<PingPongStorage>(smem_raw);
  const SegmentRows* shared_rows =
      copy_segment_rows(params, reinterpret_cast<SegmentRows*>(&smem + 1));
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&smem.full[s], 1);
      ptx::mbarrier_init(&smem.empty[s], kWarpsPerConsumer);  // one consumer reads a stage
    }
    ptx::fence_barrier_init();
  }
  __syncthreads();  // the barriers and the segment rows
  const int num_m_tiles = (params.m_extent + kTileM - 1) / kTileM;
  const int num_n_tiles = (params.n_extent + kTileN - 1) / kTileN;
  const int num_units = num_m_tiles * num_n_tiles * params.num_experts;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x != 0) return;
    ptx::prefetch_tensor_map(&tmap_a);
    ptx::prefetch_tensor_map(&tmap_b);
    PipelineState<kStages> state;
    for (int unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
      const PingPongTile tile = tile_at(params, unit, num_m_tiles, num_n_tiles, shared_rows);
      for (int k_block = 0; k_block < tile.num_k_blocks; ++k_block) {
        const int k_row = tile.k_row0 + k_block * BLOCK_K;
        produce_stage(params.wait, smem, state, kStageBytes,
                      [&](__nv_bfloat16* a_dst, __nv_bfloat16* b_dst, uint64_t* full) {
#pragma unroll
                        for (int c = 0; c < 2; ++c) {
                          ptx::tma_load_2d(a_dst + c * kMnBox, &tmap_a, full,
                                           tile.m_tile * kTileM + c * 64, k_row);
                          ptx::tma_load_2d(b_dst + c * kMnBox, &tmap_b, full,
                                           tile.n_tile * kTileN + c * 64, k_row);
                        }
                      });
      }
    }
    return;
  }

  ptx::setmaxnreg_inc<kConsumerRegisters>();
  const int consumer_idx = warpgroup - 1;
  // Turns: consumer c signals on barrier 4 + c that its mainloop is done; the other waits on it
  // before its own.
  const int my_turn_done = 4 + consumer_idx, other_turn_done = 4 + (consumer_idx ^ 1);
  PipelineState<kStages> state;
  float low[64], high[64];
  int local = 0;  // the tile's place in this CTA's walk
  for (int unit = blockIdx.x; unit < num_units; unit += gridDim.x, ++local) {
    const PingPongTile tile = tile_at(params, unit, num_m_tiles, num_n_tiles, shared_rows);
    if ((local & 1) != consumer_idx) {
      for (int k_block = 0; k_block < tile.num_k_blocks; ++k_block) state.advance();
      continue;
    }
    if (local > 0) ptx::named_barrier_sync(other_turn_done, 256);
    consume_pingpong_tile(params.wait, smem, state, tile.num_k_blocks, low, high);
    // Only when the other consumer has a next tile to start: every arrival meets a wait.
    if (unit + gridDim.x < num_units) ptx::named_barrier_arrive(my_turn_done, 256);
    store_pingpong_tile(&tmap_out, smem, params, tile, consumer_idx, low, high);
  }
  // Outstanding TMA stores read the staging tile: it must outlive them.
  if (threadIdx.x % 128 == 0) ptx::bulk_wait_group<0>();
}

}  // namespace

cudaError_t launch_weight_grad_pingpong(const ExpertGemmMaps& maps, const ExpertGemmParams& params,
                                        int num_ctas, cudaStream_t stream) {
  size_t smem_bytes = sizeof(PingPongStorage) + 1024;
  if (segments_in_shared(params.num_experts))
    smem_bytes += static_cast<size_t>(params.num_experts) * sizeof(SegmentRows);
  cudaError_t status =
      cudaFuncSetAttribute(weight_grad_pingpong_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem_bytes));
  if (status != cudaSuccess) return status;
  weight_grad_pingpong_kernel<<<num_ctas, kNumThreads, smem_bytes, stream>>>(maps.a0, maps.b0,
                                                                             maps.out, params);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("weight_grad_pingpong.cu",
                                 {kernel_symbol(&weight_grad_pingpong_kernel)});
}  // namespace

}  // namespace mok::kernels
