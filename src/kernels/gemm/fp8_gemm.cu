// The FP8 block-scaled grouped GEMMs (fp8_gemm.h): DeepSeek-V3's recipe on Hopper's FP8 tensor
// cores, with the fp32 promotion at every 128-long K-block.
//
// Grid: persistent, one 384-thread CTA per SM; CTA c takes tiles c, c + grid, ... of 128 x 128
// outputs: kRowTiles grouped by row tiles so that running CTAs share B (tile_walk.h: groups of
// kTileGroupM, or of one expert's tiles with MoeConfig::gemm_expert_groups, a kernel of its
// own); kWeightGrad expert by expert, m fastest. (One kernel for both walks, its producer reading
// each tile's coordinates a tile ahead, ran the default walk 2-4% slower: docs/perf.md, session
// 35.)
// Warp roles:
//   warpgroup 0   producer: one thread loads each K-block of 128 into a stage with TMA: the A
//                 and B tiles [128 x 128] e4m3 (16 KB each), the A tile's 128 line scales
//                 (512 B) and, kWeightGrad, the B tile's (512 B), all completing on full[s]; it
//                 gives its registers away (setmaxnreg.dec). kWeightGrad: thread 32 is the
//                 storer, which stores each tile the consumers staged (staging_full) and hands
//                 the staging tile back once the store has read it (staging_free); for
//                 accumulated gradients (Fp8WeightGradOut) it hands it back by loading the next
//                 tile's old values into it with TMA, completing on staging_free. kGather
//                 (Fp8GemmParams::row_gather): warps 1-3 gather and quantize A's rows from the
//                 tokens (fp8_row_gather.cuh), and the TMA thread waits for a tile's rows
//                 before its first K-block.
//   warpgroups 1, 2  consumers: each owns 64 rows and three 64 x 128 fp32 register tiles: two
//                 K-blocks' products in flight and the running sum. Per K-block: four wgmma
//                 m64n128k32 e4m3 into a fresh tile (scale-d 0 first); while the next block's
//                 run, the finished tile is added into the sum times its scales: Hopper's FP8
//                 accumulation keeps too few bits for long sums, so no sum runs in the tensor
//                 core longer than one 128-long block. (Issuing the next tile's first block
//                 before the epilogue measured 3-6% slower here, and 4-9% slower in the weight
//                 gradients; docs/perf.md sessions 11 and 25.) kRowTiles: scale_a[row]
//                 * scale_b (one per weight block, from the tile's B scales in shared memory),
//                 the stage released before the promotion; kWeightGrad:
//                 scale_a[m] * scale_b[n] per element (the B scales read from the stage, so
//                 the stage is released after it).
// Pipeline: kFp8Stages stages of 33 KB (the 128-byte swizzle TMA writes and wgmma reads); the
// epilogue writes bf16 into a 32 KB staging tile and stores it with TMA (epilogue.cuh's helpers;
// kWeightGrad's fp32 and accumulated forms: fp8_weight_grad_epilogue.cuh, fp32 in a 64 KB tile
// that takes a stage's memory), overlapping the next tile's mainloop: kRowTiles through the
// consumers' named barrier and their first thread, kWeightGrad through the storer and two
// mbarriers, so that its short tiles' consumers never wait for each other or issue a store. (Each
// consumer warpgroup storing its own 64 rows behind its own barrier, with the next tile's
// coordinates read a tile ahead: 7% slower in the weight gradients at dsv3_e128's 256 rows per
// expert, level elsewhere; the read-ahead alone lost 8% there; docs/perf.md sessions 26-27.) With
// Fp8GemmParams::weight_grad_staging_tiles = 2 the weight gradients alternate two staging tiles
// in four stages, so that a tile's staging waits for the store of the tile two back, not one.
// With Fp8GemmParams::swiglu_h_codes (kRowTiles, the gate/up GEMM; kSwiglu) a CTA's tiles come in
// pairs, a column tile of g and the one of u of the same columns (walk units of two tiles): g's
// epilogue stages its tile (stored only with swiglu_stores_gate_up) and leaves it; u's reads each
// thread's g pairs back and quantizes h from them and its own sums (fp8_swiglu_epilogue.cuh).
// B's scales (kRowTiles): one per 128-long K-block of the tile's weight block row. The consumers
// read the next tile's from global memory while this one runs (one per thread) and write them into
// the other of two shared-memory rows before the epilogue's barrier, so no K-block waits on a
// global load. (Read as each K-block issued, the load's latency sat in front of its wgmma:
// ptxas moves the value into a uniform register at once.)
#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/common/overlapped_launch.h"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/fp8_gemm.h"
#include "kernels/gemm/fp8_row_gather.cuh"
#include "kernels/gemm/fp8_row_tile_sources.cuh"
#include "kernels/gemm/fp8_swiglu_epilogue.cuh"
#include "kernels/gemm/fp8_weight_grad_epilogue.cuh"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/gemm/tile_walk.h"
#include "kernels/persistent/task_order.h"
#include "mok/fp8.h"
#include "mok/shape.h"

namespace mok::kernels {

namespace {

constexpr int kFp8Stages = 5;
constexpr int kFp8TileBytes = BLOCK_M * kFp8BlockK;  // A or B tile of one stage: 16 KB
constexpr int kFp8ScaleBytes = BLOCK_M * 4;
static_assert(kMaxTileKBlocks <= kConsumerThreads, "one B scale per consumer thread");

// kStagingTiles 2 (kWeightGrad's Fp8GemmParams::weight_grad_staging_tiles): the second staging
// tile takes a stage's shared memory.
template <int kStagingTiles>
constexpr int kFp8StagesWith = kStagingTiles == 1 ? kFp8Stages : kFp8Stages - 1;

template <int kStagingTiles>
struct alignas(1024) Fp8SharedStorage {
  static constexpr int kNumStagesHere = kFp8StagesWith<kStagingTiles>;
  uint8_t a[kNumStagesHere][kFp8TileBytes];
  uint8_t b[kNumStagesHere][kFp8TileBytes];
  // Each two [128 x 64] chunks (epilogue.cuh); kWeightGrad's tile t is staged in t % kStagingTiles.
  __nv_bfloat16 store_tile[kStagingTiles][BLOCK_M * kFp8TileN];
  float a_scales[kNumStagesHere][BLOCK_M];
  float b_scales[kNumStagesHere][kFp8TileN];  // kWeightGrad
  float tile_b_scales[2][kMaxTileKBlocks];  // kRowTiles: B's per K-block, by the CTA's tile parity
  int32_t expert_offsets[kMaxExperts + 1];  // kWeightGrad: the consumers' copy
  uint64_t full[kNumStagesHere];
  uint64_t empty[kNumStagesHere];
  // kWeightGrad: each staging tile handed between the consumers and the storer thread.
  uint64_t staging_full[kStagingTiles];  // a tile staged: one arrival per consumer warp
  uint64_t staging_free[kStagingTiles];  // its store has read it: the storer's one arrival
};
static_assert(sizeof(Fp8SharedStorage<1>) + 1024 <= 227 * 1024, "fits the SM's shared memory");
static_assert(sizeof(Fp8SharedStorage<2>) + 1024 <= 227 * 1024, "fits the SM's shared memory");

struct Fp8Tile {
  int m_tile, n_tile, expert;
  int k_block0;  // kWeightGrad: the expert's first row / 128
  int num_k_blocks;
};

// `expert_offsets`: kWeightGrad's [E + 1] row offsets (params' in global memory, or the consumers'
// copy in shared memory). kExpertGroups (kRowTiles): MoeConfig::gemm_expert_groups' walk, from
// the schedule's expert offsets in params; otherwise groups of kTileGroupM.
// kSwiglu (kRowTiles): tiles 2 u and 2 u + 1 are walk unit u's column tile of g and the one of u
// (the same columns of the other half), which a CTA takes in that order (fp8_next_tile).
template <Fp8GemmForm kForm, bool kExpertGroups, bool kSwiglu = false>
__device__ __forceinline__ Fp8Tile fp8_tile(const Fp8GemmParams& params,
                                            const int32_t* expert_offsets, int tile,
                                            int num_m_tiles, int num_n_tiles) {
  constexpr bool kRowTiles = kForm == Fp8GemmForm::kRowTiles;
  Fp8Tile t;
  if constexpr (kSwiglu) {
    const int half_n_tiles = num_n_tiles / 2;
    const WalkUnit walk = walk_unit(tile / 2, num_m_tiles, half_n_tiles, true);
    t.m_tile = walk.m_unit;
    t.n_tile = walk.n_tile + (tile & 1) * half_n_tiles;
  } else if constexpr (kExpertGroups) {
    expert_grouped_tile_in(tile, 0, num_m_tiles, num_n_tiles, params.expert_groups,
                           params.tile_expert, params.expert_offsets, BLOCK_M, &t.m_tile,
                           &t.n_tile);
  } else {
    const WalkUnit walk = walk_unit(tile, num_m_tiles, num_n_tiles, kRowTiles);
    t.m_tile = walk.m_unit;
    t.n_tile = walk.n_tile;
    t.expert = walk.expert;
  }
  if constexpr (kRowTiles) {
    t.expert = params.tile_expert[t.m_tile];
    t.k_block0 = 0;
    t.num_k_blocks = params.k_extent / kFp8BlockK;
  } else {
    const int begin = expert_offsets[t.expert], end = expert_offsets[t.expert + 1];
    t.k_block0 = begin / kFp8BlockK;
    t.num_k_blocks = (end - begin) / kFp8BlockK;
  }
  return t;
}

// A CTA's first tile and the one after `tile`: c, c + grid, ...; kSwiglu: the units' pairs
// 2 c, 2 c + 1, 2 (c + grid), ... (a tile past num_tiles: none left).
template <bool kSwiglu>
__device__ __forceinline__ int fp8_first_tile() {
  return kSwiglu ? 2 * static_cast<int>(blockIdx.x) : static_cast<int>(blockIdx.x);
}
template <bool kSwiglu>
__device__ __forceinline__ int fp8_next_tile(int tile) {
  if constexpr (kSwiglu) return (tile & 1) ? tile - 1 + 2 * static_cast<int>(gridDim.x) : tile + 1;
  return tile + static_cast<int>(gridDim.x);
}

// kWeightGrad's storage: kF32 forms take both staging tiles' memory as one tile (4 stages).
template <int kStagingTiles, Fp8WeightGradOut kWgradOut>
constexpr int kFp8StorageStagingTiles = fp8_weight_grad_is_f32(kWgradOut) ? 2 : kStagingTiles;

template <Fp8GemmForm kForm, bool kExpertGroups = false, int kStagingTiles = 1,
          bool kSwiglu = false, bool kGather = false,
          Fp8WeightGradOut kWgradOut = Fp8WeightGradOut::kBF16>
__global__ void __launch_bounds__(kNumThreads, 1)
    fp8_grouped_gemm_kernel(const __grid_constant__ Fp8GemmMaps maps, const Fp8GemmParams params) {
  // Launched overlapped (MoeConfig::overlap_kernel_launches): nothing below touches memory
  // before the previous kernel has completed.
  ptx::begin_after_previous_kernel();
  constexpr bool kWeightGrad = kForm == Fp8GemmForm::kWeightGrad;
  static_assert(!kExpertGroups || !kWeightGrad, "the expert groups walk row tiles");
  static_assert(kStagingTiles == 1 || (kWeightGrad && kStagingTiles == 2),
                "two staging tiles: the weight gradients' storer alternates them");
  static_assert(!kSwiglu || (!kWeightGrad && !kExpertGroups), "SwiGLU: the gate/up row tiles");
  static_assert(!kGather || (!kWeightGrad && !kExpertGroups), "the gather: the gate/up row tiles");
  // kWeightGrad's output forms but the default: one staging tile (kF32: 64 KB), which the storer
  // fills with the old values first when they accumulate.
  constexpr bool kPlainOut = kWgradOut == Fp8WeightGradOut::kBF16;
  constexpr bool kAccumulate = fp8_weight_grad_accumulates(kWgradOut);
  static_assert(kPlainOut || (kWeightGrad && kStagingTiles == 1),
                "the weight gradients' other output forms: one staging tile");
  using Storage = Fp8SharedStorage<kFp8StorageStagingTiles<kStagingTiles, kWgradOut>>;
  constexpr int kStages = Storage::kNumStagesHere;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Storage& smem = ptx::align_shared_1024<Storage>(smem_raw);
  if (kWeightGrad && threadIdx.x == 0) {  // init_pipeline fences and publishes them
    for (int b = 0; b < kStagingTiles; ++b) {
      ptx::mbarrier_init(&smem.staging_full[b], kConsumerThreads / 32);
      ptx::mbarrier_init(&smem.staging_free[b], 1);
    }
  }
  init_pipeline(smem);
  const int num_m_tiles = kWeightGrad ? params.m_extent / BLOCK_M : params.header->num_tiles;
  const int num_n_tiles = params.n_extent / kFp8TileN;
  const int num_tiles = num_m_tiles * num_n_tiles * (kWeightGrad ? params.num_experts : 1);
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    // kGather: the launch's epoch of the gather's ticket and counts (fp8_row_gather.cuh).
    const unsigned long long gather_epoch = kGather ? fp8_gather_epoch(params.row_gather) : 0ull;
    if (kGather && threadIdx.x >= 32) {  // warps 1-3: the gatherers (3 pairs of groups in
      // flight: the most that fit kProducerRegisters without a spill)
      fp8_gather_rows<3>(params.row_gather, params.header, params.k_extent);
    } else if (threadIdx.x == 0) {
      ptx::prefetch_tensor_map(&maps.a);
      ptx::prefetch_tensor_map(&maps.b);
      PipelineState<kStages> state;
      constexpr uint32_t kBytes = 2 * kFp8TileBytes + (kWeightGrad ? 2 : 1) * kFp8ScaleBytes;
      // MoeConfig::gemm_lockstep_k_blocks (lockstep.h): the row tiles' producers kept in step;
      // every tile has K / 128 K-blocks.
      const bool lockstep = !kWeightGrad && params.lockstep.ticks != nullptr &&
                            (kSwiglu ? 2 * blockIdx.x : blockIdx.x) < num_tiles;
      LockstepCta step;
      if (lockstep)  // the most tiles a CTA takes (kSwiglu: two a unit)
        step = lockstep_begin(
            params.lockstep,
            lockstep_plan(params.lockstep.lead_k_blocks, params.k_extent / kFp8BlockK,
                          kSwiglu ? 2 * ((num_tiles / 2 + gridDim.x - 1) / gridDim.x)
                                  : (num_tiles + gridDim.x - 1) / gridDim.x));
      int local_tile = 0;
      for (int tile = fp8_first_tile<kSwiglu>(); tile < num_tiles;
           tile = fp8_next_tile<kSwiglu>(tile), ++local_tile) {
        const Fp8Tile t = fp8_tile<kForm, kExpertGroups, kSwiglu>(params, params.expert_offsets,
                                                                  tile, num_m_tiles, num_n_tiles);
        if constexpr (kGather)  // the tile's A rows gathered (fp8_row_gather.cuh)
          fp8_wait_for_gathered_rows(params.wait, params.row_gather,
                                     static_cast<int64_t>(t.m_tile) * BLOCK_M,
                                     BLOCK_M / kFp8GatherChunkRows, gather_epoch);
        for (int k_block = 0; k_block < t.num_k_blocks; ++k_block) {
          if (lockstep) lockstep_k_block(params.lockstep, step, params.wait, local_tile, k_block);
          const int s = state.stage;
          const int k_group = t.k_block0 + k_block;
          if (!arm_free_stage(params, &smem.empty[s], &smem.full[s], state.phase, kBytes)) {
            state.advance();  // the no-loads ablation: the stage armed with no bytes
            continue;
          }
          if constexpr (kWeightGrad) {
            ptx::tma_load_2d(smem.a[s], &maps.a, &smem.full[s], k_group * kFp8BlockK,
                             t.m_tile * BLOCK_M);
            ptx::tma_load_2d(smem.b[s], &maps.b, &smem.full[s], k_group * kFp8BlockK,
                             t.n_tile * kFp8TileN);
            ptx::tma_load_2d(smem.a_scales[s], &maps.a_scales, &smem.full[s], t.m_tile * BLOCK_M,
                             k_group);
            ptx::tma_load_2d(smem.b_scales[s], &maps.b_scales, &smem.full[s], t.n_tile * kFp8TileN,
                             k_group);
          } else {
            const Fp8Sources src = row_tile_sources(maps, params, t.n_tile, k_block);
            ptx::tma_load_2d(smem.a[s], src.a, &smem.full[s], src.k_group * kFp8BlockK,
                             t.m_tile * BLOCK_M);
            ptx::tma_load_3d(smem.b[s], src.b, &smem.full[s], src.k_group * kFp8BlockK,
                             src.b_n_tile * kFp8TileN, t.expert);
            ptx::tma_load_2d(smem.a_scales[s], src.a_scales, &smem.full[s], t.m_tile * BLOCK_M,
                             src.k_group);
          }
          state.advance();
        }
      }
      if (lockstep) lockstep_end(params.lockstep, step, local_tile);
    } else if (kWeightGrad && threadIdx.x == 32) {
      // kWeightGrad's storer: stores each tile the consumers staged, and hands the staging
      // tile back once its store has read it, so that the consumers' epilogue is the staging
      // alone (no barrier between them, no store issued on their path). With two staging
      // tiles one store stays in flight: tile t's is issued before tile t - 1's tile is handed
      // back, which the consumers next stage into at tile t + 1.
      // kAccumulate: the staging tile's completions on staging_free are the loads of each
      // tile's old values instead (the first one here, tile t + 1's once tile t's store has
      // read it), so that the consumers find them staged.
      ptx::prefetch_tensor_map(&maps.out);
      char* staging0 = reinterpret_cast<char*>(smem.store_tile[0]);
      auto load_old_values = [&](int tile) {
        const Fp8Tile t =
            fp8_tile<kForm, false>(params, params.expert_offsets, tile, num_m_tiles, num_n_tiles);
        load_weight_grad_tile<kWgradOut>(&maps.out, staging0, &smem.staging_free[0], t.m_tile,
                                         t.n_tile, t.expert);
      };
      if (kAccumulate && static_cast<int>(blockIdx.x) < num_tiles) load_old_values(blockIdx.x);
      int local_tile = 0;
      for (int tile = blockIdx.x; tile < num_tiles; tile += gridDim.x, ++local_tile) {
        const Fp8Tile t =
            fp8_tile<kForm, false>(params, params.expert_offsets, tile, num_m_tiles, num_n_tiles);
        const int buffer = local_tile % kStagingTiles;
        const int use = local_tile / kStagingTiles;  // of this staging tile
        mbarrier_wait(params.wait, WaitSite::kStagingFull, &smem.staging_full[buffer], use & 1);
        if constexpr (kPlainOut)
          store_chunks(&maps.out, reinterpret_cast<const char*>(smem.store_tile[buffer]), 0,
                       kFp8TileN / 64, t.n_tile * kFp8TileN, params.n_extent, t.m_tile * BLOCK_M,
                       t.expert);
        else
          store_weight_grad_tile<kWgradOut>(&maps.out, staging0, t.m_tile, t.n_tile, t.expert);
        ptx::bulk_commit_group();
        if constexpr (kAccumulate) {
          ptx::bulk_wait_group_read<0>();
          if (tile + static_cast<int>(gridDim.x) < num_tiles)
            load_old_values(tile + static_cast<int>(gridDim.x));
        } else if constexpr (kStagingTiles == 1) {
          ptx::bulk_wait_group_read<0>();
          ptx::mbarrier_arrive(&smem.staging_free[0]);
        } else if (local_tile > 0) {
          ptx::bulk_wait_group_read<1>();  // the previous tile's store has read its tile
          ptx::mbarrier_arrive(&smem.staging_free[buffer ^ 1]);
        }
      }
      ptx::bulk_wait_group<0>();
    }
  } else {
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    // Warp-uniform by a shuffle, so that ptxas keeps the descriptors below in uniform registers.
    const int consumer_idx = __shfl_sync(0xffffffffu, warpgroup - 1, 0);
    // Stage 0's descriptors; stage s's are s tiles further on (16-byte units: the stages are
    // 1024-byte aligned, so only the start address moves).
    const uint64_t desc_a0 = ptx::smem_desc_k_major_sw128(smem.a[0] + consumer_idx * 64 * 128);
    const uint64_t desc_b0 = ptx::smem_desc_k_major_sw128(smem.b[0]);
    constexpr uint64_t kStageDescStep = kFp8TileBytes >> 4;
    const bool issuer = threadIdx.x == BLOCK_M;
    const int row0 = consumer_idx * 64 + fragment_row(0), row1 = row0 + 8;
    const int column0 = fragment_col(0);  // + 8 j: this thread's column pair of group j
    PipelineState<kStages> load_state, release_state;
    float block0[64], block1[64];  // two K-blocks' products in flight (wgmma accumulators)
    float sum[64];                 // the promoted fp32 sum
    // kRowTiles: this thread's B scale (K-block consumer_thread) of tile t.
    const int consumer_thread = threadIdx.x - BLOCK_M;
    auto load_tile_b_scale = [&](const Fp8Tile& t, bool valid) {
      if (kWeightGrad || !valid) return 0.0f;
      return consumer_thread < t.num_k_blocks
                 ? row_tile_b_scale(params, t.expert, t.n_tile, consumer_thread)
                 : 0.0f;
    };
    // kWeightGrad: the expert offsets copied into shared memory. A tile's first wgmma waits on
    // its K-block count, and ptxas moves offsets read from global memory into uniform registers
    // at once: an L2 round trip at every tile's head.
    if constexpr (kWeightGrad) {
      for (int e = consumer_thread; e <= params.num_experts; e += kConsumerThreads)
        smem.expert_offsets[e] = params.expert_offsets[e];
      ptx::named_barrier_sync(1, kConsumerThreads);
    }
    // kRowTiles: each tile's coordinates are read once, a tile ahead (see read_next_tile).
    Fp8Tile next{};
    if constexpr (!kWeightGrad) {
      const bool has_first = fp8_first_tile<kSwiglu>() < num_tiles;
      if (has_first)
        next = fp8_tile<kForm, kExpertGroups, kSwiglu>(
            params, smem.expert_offsets, fp8_first_tile<kSwiglu>(), num_m_tiles, num_n_tiles);
      smem.tile_b_scales[0][consumer_thread] = load_tile_b_scale(next, has_first);
      ptx::named_barrier_sync(1, kConsumerThreads);
    }
    int local_tile = 0;
    for (int tile = fp8_first_tile<kSwiglu>(); tile < num_tiles;
         tile = fp8_next_tile<kSwiglu>(tile), ++local_tile) {
      const Fp8Tile t = kWeightGrad ? fp8_tile<kForm, false>(params, smem.expert_offsets, tile,
                                                             num_m_tiles, num_n_tiles)
                                    : next;
      // kRowTiles: the next tile's coordinates and B scale, read once this tile's first K-block
      // is issued, so that the walk's divisions and the tile expert's global load stay off the
      // path to it (2-3% faster row-tile GEMMs, docs/perf.md session 27). kWeightGrad reads its
      // tile at the loop head: read a tile ahead (from global memory or from a shared-memory
      // copy of the expert offsets), its weight gradients ran 8% slower at dsv3_e128's two
      // K-blocks a tile, in session 27 as in session 26's e170d09.
      float next_tile_b_scale = 0.0f;
      auto read_next_tile = [&] {
        if constexpr (!kWeightGrad) {
          const bool has_next = fp8_next_tile<kSwiglu>(tile) < num_tiles;
          if (has_next)
            next = fp8_tile<kForm, kExpertGroups, kSwiglu>(params, smem.expert_offsets,
                                                           fp8_next_tile<kSwiglu>(tile),
                                                           num_m_tiles, num_n_tiles);
          next_tile_b_scale = load_tile_b_scale(next, has_next);
        }
      };
      const float* tile_b_scales = smem.tile_b_scales[local_tile & 1];
      // B's scale of each K-block in flight (kRowTiles).
      float scale_b0 = 1.0f, scale_b1 = 1.0f;
      // Waits for K-block `k_block`'s stage and issues its four wgmma into `block`.
      auto issue = [&](int k_block, float(&block)[64], float& scale_b) {
        if constexpr (!kWeightGrad) scale_b = tile_b_scales[k_block];
        const int s = load_state.stage;
        mbarrier_wait(params.wait, WaitSite::kGemmLoadedStage, &smem.full[s], load_state.phase);
        const uint64_t desc_a = desc_a0 + s * kStageDescStep;
        const uint64_t desc_b = desc_b0 + s * kStageDescStep;
        ptx::fence_registers(block);
        ptx::wgmma_fence();
#pragma unroll
        for (int k = 0; k < kFp8BlockK / 32; ++k)  // 32 bytes = 2 descriptor units per step
          ptx::wgmma_m64n128k32_e4m3(block, desc_a + 2 * k, desc_b + 2 * k, k > 0);
        ptx::wgmma_commit();
        load_state.advance();
      };
      // Adds the oldest K-block's finished products into the sum times their scales and hands
      // its stage back.
      auto promote = [&](float(&block)[64], float scale_b) {
        ptx::fence_registers(block);
        const int s = release_state.stage;
        const float factor0 = smem.a_scales[s][row0] * scale_b;
        const float factor1 = smem.a_scales[s][row1] * scale_b;
        if constexpr (!kWeightGrad) {
          __syncwarp();  // every lane has read its scales before the stage is handed back
          if (threadIdx.x % 32 == 0) ptx::mbarrier_arrive(&smem.empty[s]);
        }
        // Fragment register j * 4 + i * 2 + c: row row0 + 8 i, column column0 + 8 j + c.
#pragma unroll
        for (int j = 0; j < kFp8TileN / 8; ++j) {
          float2 column_scale = make_float2(1.0f, 1.0f);
          if constexpr (kWeightGrad)
            column_scale = *reinterpret_cast<const float2*>(&smem.b_scales[s][column0 + 8 * j]);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const float row_factor = i == 0 ? factor0 : factor1;
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int r = j * 4 + i * 2 + c;
              const float factor = row_factor * (c == 0 ? column_scale.x : column_scale.y);
              sum[r] = fmaf(block[r], factor, sum[r]);
            }
          }
        }
        if constexpr (kWeightGrad) {
          __syncwarp();  // the B scales were read from the stage too
          if (threadIdx.x % 32 == 0) ptx::mbarrier_arrive(&smem.empty[s]);
        }
        release_state.advance();
      };
      // K-block k + 1 runs on the tensor cores while K-block k is promoted: the two buffers
      // alternate (even blocks in block0), so the promotion's FMAs hide under the wgmma.
      // -0 + x is x for every x, -0 included: the first block's sum is its bare product.
#pragma unroll
      for (int r = 0; r < 64; ++r) sum[r] = -0.0f;
      // At the loop's head K-block k is in flight in block0, always (so that ptxas sees one
      // state there and keeps the wgmma asynchronous); every exit waits for everything. The two
      // halves stay written out: folded into one lambda over (block0, block1) and (block1,
      // block0), ptxas serialized the wgmma again (C7514).
      if (params.ablation == GemmAblation::kNoMath || t.num_k_blocks == 0) read_next_tile();
      if (params.ablation == GemmAblation::kNoMath) {
        // The stages waited for and handed back, nothing computed (the sum stays -0).
        for (int k_block = 0; k_block < t.num_k_blocks; ++k_block) {
          mbarrier_wait(params.wait, WaitSite::kGemmLoadedStage, &smem.full[load_state.stage],
                        load_state.phase);
          if (threadIdx.x % 32 == 0) ptx::mbarrier_arrive(&smem.empty[load_state.stage]);
          load_state.advance();
          release_state.advance();
        }
      } else if (t.num_k_blocks > 0) {
        issue(0, block0, scale_b0);
        read_next_tile();
        for (int k_block = 0;; k_block += 2) {
          if (k_block + 1 == t.num_k_blocks) {
            ptx::wgmma_wait<0>();
            promote(block0, scale_b0);
            break;
          }
          issue(k_block + 1, block1, scale_b1);
          ptx::wgmma_wait<1>();
          promote(block0, scale_b0);
          if (k_block + 2 == t.num_k_blocks) {
            ptx::wgmma_wait<0>();
            promote(block1, scale_b1);
            break;
          }
          issue(k_block + 2, block0, scale_b0);
          ptx::wgmma_wait<1>();
          promote(block1, scale_b1);
        }
      }
      const bool empty = t.num_k_blocks == 0;  // kWeightGrad: an expert without rows
      // The next tile's B scales, published by the staging tile's barrier; the other row is no
      // longer read (every consumer passed this tile's first barrier after the last tile's math).
      if constexpr (!kWeightGrad)
        smem.tile_b_scales[(local_tile + 1) & 1][consumer_thread] = next_tile_b_scale;
      // kWeightGrad: tile local_tile's staging tile, and its use of it.
      const int buffer = kWeightGrad ? local_tile % kStagingTiles : 0;
      const int use = kWeightGrad ? local_tile / kStagingTiles : 0;
      char* staging = reinterpret_cast<char*>(smem.store_tile[buffer]);
      auto stage = [&] {
        stage_fragments<0, kFp8TileN / 8>(staging, consumer_idx * 64, [&](int i, int j) {
          return empty ? make_float2(0.0f, 0.0f)
                       : make_float2(sum[j * 4 + i * 2], sum[j * 4 + i * 2 + 1]);
        });
      };
      if constexpr (kWeightGrad) {
        // The storer (producer warp 1) stores it: wait until the store of the tile staged
        // there last has read the staging tile, stage, and hand it over, one arrival per warp.
        // kAccumulate: until this tile's old values are loaded there (completion `use`).
        mbarrier_wait(params.wait, WaitSite::kStagingFree, &smem.staging_free[buffer],
                      kAccumulate ? (use & 1) : (use & 1) ^ 1);
        if constexpr (kPlainOut)
          stage();
        else
          stage_weight_grad_tile<kWgradOut>(staging, consumer_idx * 64, [&](int i, int j) {
            return empty ? make_float2(0.0f, 0.0f)
                         : make_float2(sum[j * 4 + i * 2], sum[j * 4 + i * 2 + 1]);
          });
        ptx::fence_proxy_async_shared();
        __syncwarp();
        if (threadIdx.x % 32 == 0) ptx::mbarrier_arrive(&smem.staging_full[buffer]);
        continue;
      }
      // kSwiglu: a unit's g tile stays staged for its u tile, whose epilogue reads each thread's
      // g pairs back from the places it wrote them (into block0, the wgmma accumulators, which
      // stay live from tile to tile: no registers beyond the default epilogue's) and its u pairs
      // into block1, then quantizes h (fp8_swiglu_epilogue.cuh). g and u are stored unless the
      // forward keeps no context.
      const bool u_tile = kSwiglu && t.n_tile >= num_n_tiles / 2;
      const bool stores = !kSwiglu || params.swiglu_stores_gate_up != 0;
      acquire_staging_tile(issuer);
      if constexpr (kSwiglu) {
        const int row_base = consumer_idx * 64;
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
          for (int j = 0; j < kFp8TileN / 8; ++j) {
            const __nv_bfloat162 pair =
                __floats2bfloat162_rn(sum[j * 4 + i * 2], sum[j * 4 + i * 2 + 1]);
            const int offset =
                staged_pair_offset((j / 8) * kStageChunkBytes, row_base + fragment_row(i), j);
            block1[16 * i + j] = __uint_as_float(bf16x2_bits(pair));
            block0[16 * i + j] = *reinterpret_cast<const float*>(staging + offset);
            if (!u_tile || stores) *reinterpret_cast<__nv_bfloat162*>(staging + offset) = pair;
          }
      } else {
        stage();
      }
      publish_staging_tile();
      if (issuer && stores) {
        const int column = t.n_tile * kFp8TileN;
        const bool second = params.n_split > 0 && column >= params.n_split;
        store_chunks(second ? &maps.out2 : &maps.out, staging, 0, kFp8TileN / 64,
                     second ? column - params.n_split : column,
                     second ? params.n_extent - params.n_split
                            : (params.n_split > 0 ? params.n_split : params.n_extent),
                     t.m_tile * BLOCK_M, 0);
        ptx::bulk_commit_group();
      }
      if (u_tile)  // h's group (t.n_tile - num_n_tiles / 2) of this warpgroup's rows
        swiglu_quantize_fragment_rows(
            params, static_cast<int64_t>(t.m_tile) * BLOCK_M + consumer_idx * 64,
            t.n_tile - num_n_tiles / 2,
            [&](int i, int j) { return __float_as_uint(block0[16 * i + j]); },
            [&](int i, int j) { return __float_as_uint(block1[16 * i + j]); });
    }
    if (issuer) ptx::bulk_wait_group<0>();  // kRowTiles: the last store reads the staging tile
  }
}

template <Fp8GemmForm kForm, bool kExpertGroups = false, int kStagingTiles = 1,
          bool kSwiglu = false, bool kGather = false,
          Fp8WeightGradOut kWgradOut = Fp8WeightGradOut::kBF16>
cudaError_t launch_form(const Fp8GemmMaps& maps, const Fp8GemmParams& params, int num_ctas,
                        KernelStream on) {
  const size_t smem_bytes =
      sizeof(Fp8SharedStorage<kFp8StorageStagingTiles<kStagingTiles, kWgradOut>>) + 1024;
  auto* kernel =
      &fp8_grouped_gemm_kernel<kForm, kExpertGroups, kStagingTiles, kSwiglu, kGather, kWgradOut>;
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem_bytes));
  if (status != cudaSuccess) return status;
  return launch_maybe_overlapped(kernel, num_ctas, kNumThreads, smem_bytes, on, 1, maps, params);
}

}  // namespace

cudaError_t launch_fp8_grouped_gemm(const Fp8GemmMaps& maps, const Fp8GemmParams& params,
                                    int num_ctas, KernelStream on) {
  if (params.n_extent <= 0 || params.n_extent % kFp8TileN != 0) return cudaErrorInvalidValue;
  if (params.form == Fp8GemmForm::kWeightGrad) {
    if (params.m_extent <= 0 || params.m_extent % BLOCK_M != 0 || params.num_experts < 0 ||
        params.num_experts > kMaxExperts)
      return cudaErrorInvalidValue;
    constexpr auto kWgrad = Fp8GemmForm::kWeightGrad;
    using Out = Fp8WeightGradOut;
    const Out out = params.weight_grad_out;
    if (out != Out::kBF16 && params.weight_grad_staging_tiles != 1) return cudaErrorInvalidValue;
    if (out == Out::kBF16Accumulate)
      return launch_form<kWgrad, false, 1, false, false, Out::kBF16Accumulate>(maps, params,
                                                                               num_ctas, on);
    if (out == Out::kF32)
      return launch_form<kWgrad, false, 1, false, false, Out::kF32>(maps, params, num_ctas, on);
    if (out == Out::kF32Accumulate)
      return launch_form<kWgrad, false, 1, false, false, Out::kF32Accumulate>(maps, params,
                                                                              num_ctas, on);
    if (out != Out::kBF16) return cudaErrorInvalidValue;
    if (params.weight_grad_staging_tiles == 2)
      return launch_form<kWgrad, false, 2>(maps, params, num_ctas, on);
    if (params.weight_grad_staging_tiles != 1) return cudaErrorInvalidValue;
    return launch_form<kWgrad>(maps, params, num_ctas, on);
  }
  if (params.k_extent <= 0 || params.k_extent % kFp8BlockK != 0 ||
      params.k_extent > kFp8MaxReduction || params.n_split < 0 || params.n_split % kFp8TileN != 0 ||
      params.n_split >= params.n_extent || params.k_split < 0 || params.k_split % kFp8BlockK != 0 ||
      params.k_split >= params.k_extent || (params.n_split > 0 && params.k_split > 0))
    return cudaErrorInvalidValue;
  if (params.swiglu_h_codes != nullptr &&
      (params.n_split <= 0 || params.n_extent != 2 * params.n_split ||
       params.swiglu_h_scales == nullptr || params.swiglu_h_rows <= 0 ||
       (params.tile_rows == 128 && params.expert_groups > 0)))
    return cudaErrorInvalidValue;
  const Fp8RowGather& gather = params.row_gather;
  if (gather.tokens != nullptr &&
      (gather.row_pair == nullptr || gather.top_k <= 0 || gather.codes == nullptr ||
       gather.scales == nullptr || gather.capacity_rows <= 0 ||
       gather.capacity_rows % kFp8GatherChunkRows != 0 || gather.ticket == nullptr ||
       gather.chunk_rows_done == nullptr || gather.epoch == nullptr ||
       (params.tile_rows == 128 && params.expert_groups > 0)))
    return cudaErrorInvalidValue;
  if (params.tile_rows == 192) return launch_fp8_gemm_192_rows(maps, params, num_ctas, on);
  if (params.tile_rows != 128) return cudaErrorInvalidValue;
  if (gather.tokens != nullptr)
    return params.swiglu_h_codes != nullptr
               ? launch_form<Fp8GemmForm::kRowTiles, false, 1, true, true>(maps, params, num_ctas,
                                                                           on)
               : launch_form<Fp8GemmForm::kRowTiles, false, 1, false, true>(maps, params, num_ctas,
                                                                            on);
  if (params.swiglu_h_codes != nullptr)
    return launch_form<Fp8GemmForm::kRowTiles, false, 1, true>(maps, params, num_ctas, on);
  if (params.expert_groups > 0)
    return launch_form<Fp8GemmForm::kRowTiles, true>(maps, params, num_ctas, on);
  return launch_form<Fp8GemmForm::kRowTiles>(maps, params, num_ctas, on);
}

}  // namespace mok::kernels
