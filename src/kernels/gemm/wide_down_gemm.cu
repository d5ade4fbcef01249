// The forward's down GEMM in 256 x 192 tiles (MoeConfig::gemm_wide_down_tiles; issue 16): y =
// bf16(h Wd^T) rows in schedule order, the kDownStore form of expert_gemm.cu with taller and
// narrower tiles.
//
// Why: the row-tile GEMMs are bound by the fabric between the L2's two partitions, which
// carries a fixed share of the bytes the SMs read (docs/perf.md, session 17). The bytes per
// FLOP of a tile go as 1/tile_M + 1/tile_N: 256 x 192 reads 22% fewer than 128 x 256.
//
// Grid: persistent, one 384-thread CTA per SM. A unit is one row unit (wide_tile_walk.h: one or
// two 128-row schedule tiles of one expert) by one 192-column tile of H; CTA c takes units c,
// c + grid, ..., grouped kTileGroupM row units at a time and swept n-major (task_order.h's
// grouped_tile), as the expert GEMM's tiles go, so CTAs running together share the weight
// columns of one expert in L2. Each CTA first writes the row units' prefix (unit_start) into
// shared memory: warp 0 scans the experts' unit counts.
// Warp roles:
//   warpgroup 0, thread 0  the TMA producer: per K-block of 64, A = the unit's h rows (one or two
//                [128 x 64] boxes) and B = Wd rows [192 x 64] of its expert, into a ring of
//                kWideStages stages; it waits on empty[s] before reusing stage s. The rest of
//                warpgroup 0 idles (setmaxnreg.dec to 40).
//   warpgroups 1, 2  consumers (setmaxnreg.inc to 232). A two-tile unit: consumer c owns rows
//                [128c, 128c + 128) as two m64n192 accumulators (192 registers); a one-tile
//                unit: rows [64c, 64c + 64), one accumulator. Per K-block: wait full[s], issue
//                the wgmmas, keep one K-block in flight, release the previous stage.
// Epilogue: one 128 x 192 bf16 staging tile (three 128B-swizzled [128 x 64] chunks, as
// epilogue.cuh lays them out). A two-tile unit stages consumer 0's rows, whose first thread
// stores them with TMA and waits until the store has read the tile, then hands the tile to
// consumer 1 (named barrier 1, both consumers), which stages and stores its rows. A one-tile
// unit stages both consumers' 64 rows at once. Before the next unit writes the tile, each
// storing thread waits for its store's reads.
// Shared memory: three stages of A 32 KB + B 24 KB, the 48 KB staging tile and the units'
// prefix (4 KB at most), 221 KB.
// Bits: each output element gets the same products in the same K order as in the 128 x 256
// tiles (m64n192 accumulates each element as m64n256 does), and the same single rounding.
// Not here: the expert-parallel push from the staging tile, CTA pairs and 64-row tiles (the
// config refuses the first two with this form; the padding rows are computed).
#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/gemm/launch.h"
#include "kernels/gemm/wide_tile_walk.h"
#include "kernels/persistent/task_order.h"
#include "mok/config.h"

namespace mok::kernels {

namespace {

constexpr int kWideTileM = 256;
constexpr int kWideTileN = 192;
constexpr int kWideStages = 3;
constexpr int kWideProducerRegisters = 40;
constexpr int kWideConsumerRegisters = 232;
constexpr int kWideChunks = kWideTileN / 64;               // staging chunks of 64 columns
constexpr int kWideTileBBytes = kWideTileN * BLOCK_K * 2;  // 24 KB
constexpr int kRowBoxBytes = kWideTileRows * BLOCK_K * 2;  // one [128 x 64] box of A: 16 KB
// Named barriers of the consumers (0 is __syncthreads): 1 both consumers, 2 + c consumer c.
constexpr int kBothConsumersBarrier = 1;

// The ring of 256 x 64 A and 192 x 64 B stages, and a staging tile of 128 rows (one consumer's).
using WideStorage = GemmSharedStorage<kWideStages, kWideTileM, kWideTileN, kWideTileRows>;
static_assert(kMaxWideExperts == kMaxWideDownExperts, "the config's limit is the kernel's");
static_assert(sizeof(__nv_bfloat16) * kWideTileN * BLOCK_K % 1024 == 0, "stages stay 1024-aligned");
static_assert(sizeof(WideStorage) + 1024 + (kMaxWideExperts + 1) * sizeof(int32_t) <= 227 * 1024,
              "the ring, the staging tile and the units' prefix fit the SM's shared memory");

// The launch's window of schedule tiles: its macrobatch clipped to the filled tiles.
struct WideWindow {
  int32_t m_begin;
  int32_t m_end;
};
__device__ __forceinline__ WideWindow wide_window(const ExpertGemmParams& params) {
  const int32_t filled = params.header->num_tiles;
  return {min(params.macrobatch.tile_begin, filled), min(params.macrobatch.tile_end, filled)};
}

// Warp 0 writes unit_start[0..E]: the exclusive prefix of each expert's row units, 32 experts
// per step (a shuffle scan), then the caller's barrier publishes it.
__device__ __forceinline__ void scan_row_units(const ExpertGemmParams& params,
                                               const WideWindow& window, int32_t* unit_start) {
  const int lane = threadIdx.x % 32;
  int32_t carried = 0;
  for (int32_t base = 0; base < params.num_experts; base += 32) {
    const int32_t expert = base + lane;
    int32_t units = 0;
    if (expert < params.num_experts) {
      int32_t first = 0, end = 0;
      expert_window_tiles(params.expert_offsets, expert, window.m_begin, window.m_end, &first,
                          &end);
      units = wide_row_units(first, end);
    }
    int32_t inclusive = units;
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int32_t below = __shfl_up_sync(0xffffffffu, inclusive, offset);
      if (lane >= offset) inclusive += below;
    }
    if (expert < params.num_experts) unit_start[expert] = carried + inclusive - units;
    carried += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  if (lane == 0) unit_start[params.num_experts] = carried;
}

struct WideTile {
  WideRowUnit rows;
  int32_t n_tile;
};

__device__ __forceinline__ WideTile wide_tile(const ExpertGemmParams& params,
                                              const WideWindow& window, const int32_t* unit_start,
                                              int32_t num_n_tiles, int32_t unit) {
  int32_t row_unit = 0;
  WideTile tile;
  grouped_tile(unit, unit_start[params.num_experts], num_n_tiles, &row_unit, &tile.n_tile);
  tile.rows = wide_row_unit(row_unit, unit_start, params.num_experts, params.expert_offsets,
                            window.m_begin, window.m_end);
  return tile;
}

// One consumer's mainloop over a unit: kTwo (a two-tile unit) accumulates its rows [128c, 128c
// + 128) into acc0 (the first 64) and acc1; otherwise rows [64c, 64c + 64) into acc0.
template <bool kTwo, typename State>
__device__ __forceinline__ void consume_wide_tile(const WaitContext& wait, WideStorage& smem,
                                                  State& state, int num_k_blocks, int consumer_idx,
                                                  float (&acc0)[96], float (&acc1)[96]) {
  const bool releases = (threadIdx.x % 32) == 0;
  int previous_stage = -1;
  const int first_row = kTwo ? consumer_idx * 128 : consumer_idx * 64;
  for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
    mbarrier_wait(wait, WaitSite::kGemmLoadedStage, &smem.full[state.stage], state.phase);
    const uint64_t desc_a0 =
        ptx::smem_desc_k_major_sw128(smem.a[state.stage] + first_row * BLOCK_K);
    const uint64_t desc_a1 =
        ptx::smem_desc_k_major_sw128(smem.a[state.stage] + (first_row + 64) * BLOCK_K);
    const uint64_t desc_b = ptx::smem_desc_k_major_sw128(smem.b[state.stage]);
    ptx::fence_registers(acc0);
    if constexpr (kTwo) ptx::fence_registers(acc1);
    ptx::wgmma_fence();
#pragma unroll
    for (int k = 0; k < BLOCK_K / 16; ++k) {
      const bool scale_d = k_block > 0 || k > 0;
      const uint64_t step = k * k16_step<false>();
      ptx::wgmma_m64n192k16_bf16<0, 0>(acc0, desc_a0 + step, desc_b + step, scale_d);
      if constexpr (kTwo)
        ptx::wgmma_m64n192k16_bf16<0, 0>(acc1, desc_a1 + step, desc_b + step, scale_d);
    }
    ptx::wgmma_commit();
    ptx::fence_registers(acc0);
    if constexpr (kTwo) ptx::fence_registers(acc1);
    ptx::wgmma_wait<1>();
    if (previous_stage >= 0 && releases) ptx::mbarrier_arrive(&smem.empty[previous_stage]);
    previous_stage = state.stage;
    state.advance();
  }
  ptx::wgmma_wait<0>();
  ptx::fence_registers(acc0);
  if constexpr (kTwo) ptx::fence_registers(acc1);
  if (releases && previous_stage >= 0) ptx::mbarrier_arrive(&smem.empty[previous_stage]);
}

// Writes an accumulator (rows [row_base, row_base + 64) of the staging tile, 24 column groups).
__device__ __forceinline__ void stage_wide(char* tile, int row_base, const float (&acc)[96]) {
  stage_fragments<0, 3 * 8>(tile, row_base, [&](int i, int j) {
    return make_float2(acc[j * 4 + i * 2], acc[j * 4 + i * 2 + 1]);
  });
}

// Issuer: the staging tile's 128 rows to y at `row`, columns [n_tile * 192, + 192) clipped to H.
__device__ __forceinline__ void store_wide(const CUtensorMap* out, const char* tile, int n_tile,
                                           int n_extent, int row) {
  store_chunks(out, tile, 0, kWideChunks, n_tile * kWideTileN, n_extent, row, 0);
  ptx::bulk_commit_group();
}

// The consumers' epilogue of one unit (see the map above). `issuer`: this consumer's first
// thread; its previous store has read the tile once it passes the first barrier.
__device__ __forceinline__ void wide_epilogue(const CUtensorMap* out, WideStorage& smem,
                                              const ExpertGemmParams& params, const WideTile& tile,
                                              int consumer_idx, bool issuer,
                                              const float (&acc0)[96], const float (&acc1)[96]) {
  char* staging = reinterpret_cast<char*>(smem.store_tile);
  // Rows of y: full size, in schedule rows (out_row_base 0 for the routed and shared y).
  const int row = tile.rows.m_tile * kWideTileRows - params.macrobatch.out_row_base;
  if (issuer) ptx::bulk_wait_group_read<0>();
  ptx::named_barrier_sync(kBothConsumersBarrier, kConsumerThreads);
  if (tile.rows.num_tiles == 1) {
    stage_wide(staging, consumer_idx * 64, acc0);
    ptx::fence_proxy_async_shared();
    ptx::named_barrier_sync(kBothConsumersBarrier, kConsumerThreads);
    if (issuer && consumer_idx == 0) store_wide(out, staging, tile.n_tile, params.n_extent, row);
    return;
  }
  // Two tiles: consumer 0's 128 rows, then consumer 1's.
  if (consumer_idx == 0) {
    stage_wide(staging, 0, acc0);
    stage_wide(staging, 64, acc1);
    ptx::fence_proxy_async_shared();
    ptx::named_barrier_sync(2, 128);
    if (issuer) {
      store_wide(out, staging, tile.n_tile, params.n_extent, row);
      ptx::bulk_wait_group_read<0>();
    }
  }
  ptx::named_barrier_sync(kBothConsumersBarrier, kConsumerThreads);  // the hand-off
  if (consumer_idx == 1) {
    stage_wide(staging, 0, acc0);
    stage_wide(staging, 64, acc1);
    ptx::fence_proxy_async_shared();
    ptx::named_barrier_sync(3, 128);
    if (issuer) store_wide(out, staging, tile.n_tile, params.n_extent, row + kWideTileRows);
  }
}

__global__ void __launch_bounds__(kNumThreads, 1)
    wide_down_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a,
                          const __grid_constant__ CUtensorMap tmap_b,
                          const __grid_constant__ CUtensorMap tmap_out,
                          const ExpertGemmParams params) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  WideStorage& smem = ptx::align_shared_1024<WideStorage>(smem_raw);
  int32_t* unit_start = reinterpret_cast<int32_t*>(&smem + 1);
  const WideWindow window = wide_window(params);
  if (threadIdx.x < 32) scan_row_units(params, window, unit_start);
  init_pipeline<false>(smem);  // its barrier also publishes unit_start
  const int32_t num_n_tiles = (params.n_extent + kWideTileN - 1) / kWideTileN;
  const int32_t num_units = unit_start[params.num_experts] * num_n_tiles;
  const int32_t num_k_blocks = params.k_extent / BLOCK_K;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kWideProducerRegisters>();
    if (threadIdx.x != 0) return;
    ptx::prefetch_tensor_map(&tmap_a);
    ptx::prefetch_tensor_map(&tmap_b);
    PipelineState<kWideStages> state;
    for (int32_t unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
      const WideTile tile = wide_tile(params, window, unit_start, num_n_tiles, unit);
      const int row = tile.rows.m_tile * kWideTileRows - params.macrobatch.ring_row_base;
      const uint32_t bytes = tile.rows.num_tiles * kRowBoxBytes + kWideTileBBytes;
      for (int k_block = 0; k_block < num_k_blocks; ++k_block)
        produce_stage(params.wait, smem, state, bytes,
                      [&](__nv_bfloat16* a_dst, __nv_bfloat16* b_dst, uint64_t* full) {
                        const int k = k_block * BLOCK_K;
                        for (int t = 0; t < tile.rows.num_tiles; ++t)
                          ptx::tma_load_2d(a_dst + t * kWideTileRows * BLOCK_K, &tmap_a, full, k,
                                           row + t * kWideTileRows);
                        ptx::tma_load_3d(b_dst, &tmap_b, full, k, tile.n_tile * kWideTileN,
                                         tile.rows.expert);
                      });
    }
    return;
  }
  ptx::setmaxnreg_inc<kWideConsumerRegisters>();
  const int consumer_idx = warpgroup - 1;
  const bool issuer = threadIdx.x % 128 == 0;
  PipelineState<kWideStages> state;
  float acc0[96], acc1[96];
  for (int32_t unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
    const WideTile tile = wide_tile(params, window, unit_start, num_n_tiles, unit);
    if (tile.rows.num_tiles == 2)
      consume_wide_tile<true>(params.wait, smem, state, num_k_blocks, consumer_idx, acc0, acc1);
    else
      consume_wide_tile<false>(params.wait, smem, state, num_k_blocks, consumer_idx, acc0, acc1);
    wide_epilogue(&tmap_out, smem, params, tile, consumer_idx, issuer, acc0, acc1);
  }
  // Outstanding TMA stores read the staging tile: it must outlive them.
  if (issuer) ptx::bulk_wait_group<0>();
}

}  // namespace

cudaError_t launch_wide_down_gemm(const WideDownGemmMaps& maps, const ExpertGemmParams& params,
                                  int num_ctas, cudaStream_t stream) {
  if (params.num_experts > kMaxWideExperts || params.k_extent % BLOCK_K != 0)
    return cudaErrorInvalidValue;
  const size_t smem_bytes = sizeof(WideStorage) + 1024 + (params.num_experts + 1) * sizeof(int32_t);
  cudaError_t status = cudaFuncSetAttribute(
      wide_down_gemm_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
      static_cast<int>(sizeof(WideStorage) + 1024 + (kMaxWideExperts + 1) * sizeof(int32_t)));
  if (status != cudaSuccess) return status;
  wide_down_gemm_kernel<<<num_ctas, kNumThreads, smem_bytes, stream>>>(maps.a, maps.b, maps.out,
                                                                       params);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("wide_down_gemm.cu", {kernel_symbol(&wide_down_gemm_kernel)});
}  // namespace

}  // namespace mok::kernels
