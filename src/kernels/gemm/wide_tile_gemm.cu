// The row-tile GEMMs in 256 x 192 tiles (MoeConfig::gemm_wide_tiles; issue 16): the forward's
// gate/up GEMM with its SwiGLU (kGateUpSwiGLU: 96 gate + 96 up columns, h, g and u out) and its
// down GEMM (kDownStore: y = bf16(h Wd^T)), and the backward's two dgrads (kDownGrad: dh_raw =
// bf16(d_out Wd); kGateUpGradStore: dx = bf16(d_g Wg + d_u Wu)): the forms of expert_gemm.cu
// with taller and narrower tiles, the same operands and outputs.
//
// Why: the row-tile GEMMs are bound by the fabric between the L2's two partitions, which
// carries a fixed share of the bytes the SMs read (docs/perf.md, session 17). The bytes per
// FLOP of a tile go as 1/tile_M + 1/tile_N: 256 x 192 reads 22% fewer than 128 x 256.
//
// Grid: persistent, one 384-thread CTA per SM. A unit is one row unit (wide_tile_walk.h: one or
// two 128-row schedule tiles of one expert) by one 192-column tile of the output; CTA c takes
// units c, c + grid, ..., grouped params.tile_group row units at a time and swept n-major
// (task_order.h's grouped_tile_in), as the expert GEMM's tiles go, so CTAs running together share
// the weight columns of one expert in L2. Each CTA first writes the row units' prefix
// (unit_start) into shared memory: warp 0 scans the experts' unit counts.
// Warp roles:
//   warpgroup 0, thread 0  the TMA producer: per K-block of 64, A = the unit's rows (one or two
//                K-major [128 x 64] boxes) and B = 192 columns of its expert's weights (96 gate
//                and 96 up rows for gate/up; K-major [192 x 64] for kDownStore; three MN-major
//                [64 x 64] chunks for the dgrads), into a ring of kWideStages stages; it waits
//                on empty[s] before reusing stage s. With the gate/up form's fused local
//                dispatch it first waits for each tile's gathered rows.
//   warpgroup 0, warps 1-3  the gate/up form's gatherers (dispatch_local.cuh); otherwise idle
//                (setmaxnreg.dec to 48).
//   warpgroups 1, 2  consumers (setmaxnreg.inc to 232). A two-tile unit: consumer c owns rows
//                [128c, 128c + 128) as two m64n192 accumulators (192 registers); a one-tile
//                unit: rows [64c, 64c + 64), one accumulator. Per K-block: wait full[s], issue
//                the wgmmas, keep one K-block in flight, release the previous stage.
// Epilogue: one 128 x 192 bf16 staging tile (three 128B-swizzled [128 x 64] chunks, as
// epilogue.cuh lays them out), every step between barriers of both consumers. A two-tile unit
// stages consumer 0's rows, which consumer 0's first thread stores with TMA (waiting until the
// store has read the tile), then consumer 1's rows the same way. A one-tile unit stages both
// consumers' 64 rows at once. Before the next unit writes the tile, the storing thread waits
// for its store's reads. The gate/up form copies the staged g and u out instead, all 256
// consumer threads with 16-byte stores, and computes h from them (copy_out_swiglu): 96 columns
// of a tile of 64-column chunks are no TMA box.
// Shared memory: three stages of A 32 KB + B 24 KB, the 48 KB staging tile and the units'
// prefix (4 KB at most), 221 KB.
// Bits: each output element gets the same products in the same K order as in the 128 x 256
// tiles (m64n192 accumulates each element as m64n256 does), and the same single rounding.
// Not here: the expert-parallel pull and push (the config refuses the in-GEMM communication with
// these tiles), CTA pairs (refused too) and 64-row tiles (the padding rows are computed).
#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/gemm_loads.cuh"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/gemm/launch.h"
#include "kernels/gemm/lockstep.h"
#include "kernels/gemm/wide_tile_walk.h"
#include "kernels/persistent/task_order.h"
#include "kernels/stages/dispatch_local.cuh"
#include "kernels/stages/swiglu.cuh"
#include "mok/config.h"

namespace mok::kernels {

namespace {

constexpr int kWideTileM = 256;
constexpr int kWideTileN = 192;
constexpr int kWideStages = 3;
// 2 x 128 x 232 + 128 x 40 = 64,512, the launch's pool: two m64n192 accumulators (192
// registers) need the consumers' 232, which leaves the producer warpgroup (the TMA thread and
// the fused gather's warps) 40. (48 asked for 1,024 registers more than the pool holds, and the
// second consumer's setmaxnreg.inc never returned.)
constexpr int kWideProducerRegisters = 40;
constexpr int kWideConsumerRegisters = 232;
static_assert(register_split_fits(kWideProducerRegisters, kWideConsumerRegisters, 2),
              "the 256 x 192 tiles' register split fits the launch's pool");
constexpr int kWideChunks = kWideTileN / 64;               // staging chunks of 64 columns
constexpr int kWideTileBBytes = kWideTileN * BLOCK_K * 2;  // 24 KB
constexpr int kRowBoxBytes = kWideTileRows * BLOCK_K * 2;  // one [128 x 64] box of A: 16 KB
// The consumers' named barrier (0 is __syncthreads).
constexpr int kBothConsumersBarrier = 1;

// The ring of 256 x 64 A and 192 x 64 B stages, and a staging tile of 128 rows (one consumer's).
using WideStorage = GemmSharedStorage<kWideStages, kWideTileM, kWideTileN, kWideTileRows>;
static_assert(sizeof(__nv_bfloat16) * kWideTileN * BLOCK_K % 1024 == 0, "stages stay 1024-aligned");
static_assert(sizeof(WideStorage) + 1024 + (kMaxWideTileExperts + 1) * sizeof(int32_t) <=
                  227 * 1024,
              "the ring, the staging tile and the units' prefix fit the SM's shared memory");

// Output columns of a column tile: 192, or for the gate/up form 96 columns of h (its 192
// accumulator columns are 96 gate then 96 up).
template <ExpertGemmForm kForm>
constexpr int kWideColumns = kForm == ExpertGemmForm::kGateUpSwiGLU ? kWideTileN / 2 : kWideTileN;

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
  grouped_tile_in(unit, unit_start[params.num_experts], num_n_tiles, params.tile_group, &row_unit,
                  &tile.n_tile);
  tile.rows = wide_row_unit(row_unit, unit_start, params.num_experts, params.expert_offsets,
                            window.m_begin, window.m_end);
  return tile;
}

// One consumer's mainloop over a unit: kTwo (a two-tile unit) accumulates its rows [128c, 128c
// + 128) into acc0 (the first 64) and acc1; otherwise rows [64c, 64c + 64) into acc0.
template <bool kTwo, bool kBMnMajor, typename State>
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
    const uint64_t desc_b = operand_desc<kBMnMajor>(smem.b[state.stage]);
    ptx::fence_registers(acc0);
    if constexpr (kTwo) ptx::fence_registers(acc1);
    ptx::wgmma_fence();
#pragma unroll
    for (int k = 0; k < BLOCK_K / 16; ++k) {
      const bool scale_d = k_block > 0 || k > 0;
      const uint64_t step_a = k * k16_step<false>(), step_b = k * k16_step<kBMnMajor>();
      ptx::wgmma_m64n192k16_bf16<0, kBMnMajor>(acc0, desc_a0 + step_a, desc_b + step_b, scale_d);
      if constexpr (kTwo)
        ptx::wgmma_m64n192k16_bf16<0, kBMnMajor>(acc1, desc_a1 + step_a, desc_b + step_b, scale_d);
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

// Issuer: the staging tile's 128 rows to `out` at `row`, columns [n_tile * 192, + 192) clipped
// to n_extent.
__device__ __forceinline__ void store_wide(const CUtensorMap* out, const char* tile, int n_tile,
                                           int n_extent, int row) {
  store_chunks(out, tile, 0, kWideChunks, n_tile * kWideTileN, n_extent, row, 0);
  ptx::bulk_commit_group();
}

// The consumers' epilogue of one unit (see the map above): the staging tile's hand-off.
// emit(staging, row_offset, thread, threads) writes the staged 128 rows out, unit rows
// [row_offset, + 128), run by all 256 consumer threads (`thread` in [0, 256)): a TMA store by
// thread 0, consumer 0's first thread, or the gate/up form's copy-out by all of them. `issuer`
// (consumer 0's first thread) waits for its TMA store to read the tile before the tile is
// written again (a no-op where nothing was stored). Every barrier here takes both consumers:
// the two-tile hand-off with per-consumer barriers was as correct, but compute-sanitizer's
// racecheck does not follow a hand-off across barriers of different ids (it flagged a minimal
// probe of that pattern, docs/perf.md session 18), and both consumers copying each half halves
// the copy-out.
template <typename Emit>
__device__ __forceinline__ void wide_epilogue(WideStorage& smem, const WideTile& tile,
                                              int consumer_idx, bool issuer,
                                              const float (&acc0)[96], const float (&acc1)[96],
                                              Emit emit) {
  char* staging = reinterpret_cast<char*>(smem.store_tile);
  const int thread = consumer_idx * 128 + threadIdx.x % 128;
  if (issuer) ptx::bulk_wait_group_read<0>();
  ptx::named_barrier_sync(kBothConsumersBarrier, kConsumerThreads);
  if (tile.rows.num_tiles == 1) {
    stage_wide(staging, consumer_idx * 64, acc0);
    ptx::fence_proxy_async_shared();
    ptx::named_barrier_sync(kBothConsumersBarrier, kConsumerThreads);
    emit(staging, 0, thread, kConsumerThreads);
    return;
  }
  // Two tiles: consumer 0's 128 rows, then consumer 1's.
  for (int half = 0; half < 2; ++half) {
    if (half == 1) {  // the hand-off: the first half has left the tile
      if (issuer) ptx::bulk_wait_group_read<0>();
      ptx::named_barrier_sync(kBothConsumersBarrier, kConsumerThreads);
    }
    if (consumer_idx == half) {
      stage_wide(staging, 0, acc0);
      stage_wide(staging, 64, acc1);
      ptx::fence_proxy_async_shared();
    }
    ptx::named_barrier_sync(kBothConsumersBarrier, kConsumerThreads);
    emit(staging, half * kWideTileRows, thread, kConsumerThreads);
  }
}

// The gate/up form's epilogue. A 96-column slice of a tile of 64-column chunks is no TMA box,
// so the consumers copy the staged rows out with 16-byte stores: bf16(g) and bf16(u) (the
// forward context) and h = bf16(swiglu(g, u)) computed from them 16 bytes at a time, as
// epilogue.cuh's stage_swiglu does (the same function of the same bf16 values: the same bits).
// Threads `thread` of `threads` copy the staging tile's 128 rows to output rows row0 + r.
__device__ __forceinline__ void copy_out_swiglu(const WideSwigluOutputs& outs,
                                                const ExpertGemmParams& params, const char* staging,
                                                int row0, int col0, int thread, int threads) {
  constexpr int kUnits = kWideTileN / 2 / 8;  // 16-byte units of the 96 columns
  const int64_t ld = params.n_extent;         // I
  auto unit_at = [&](int r, int j) {
    return *reinterpret_cast<const uint4*>(staging + (j / 8) * kStageChunkBytes + r * 128 +
                                           (((j % 8) ^ (r % 8)) << 4));
  };
  for (int q = thread; q < kWideTileRows * kUnits; q += threads) {
    const int r = q / kUnits, v = q % kUnits;
    const int col = col0 + 8 * v;
    if (col >= params.n_extent) continue;
    const uint4 gate = unit_at(r, v), up = unit_at(r, kUnits + v);
    const uint4 h = swiglu_forward_unit(gate, up, params.swiglu_limit);
    const int64_t at = static_cast<int64_t>(row0 + r) * ld + col;
    *reinterpret_cast<uint4*>(outs.gate + at) = gate;
    *reinterpret_cast<uint4*>(outs.up + at) = up;
    *reinterpret_cast<uint4*>(outs.h + at) = h;
  }
}

struct WideMaps {
  const CUtensorMap* a0;
  const CUtensorMap* a1;
  const CUtensorMap* b0;
  const CUtensorMap* b1;
};

// The MN-major B chunks of a unit's column tile that lie inside the output's N (the last tile
// of H = 1024 has one: a chunk wholly past the edge is not loaded, and the columns it would
// feed are clipped from the store).
__device__ __forceinline__ int wide_b_chunks(const ExpertGemmParams& params, const WideTile& tile) {
  const int left = params.n_extent - tile.n_tile * kWideTileN;
  return left >= kWideTileN ? kWideChunks : (left + 63) / 64;
}

// The bytes a unit's K-block stage receives: its row boxes of A and its B (one K-major box,
// partly zero-filled past N, or the MN-major chunks inside N).
template <ExpertGemmForm kForm>
__device__ __forceinline__ uint32_t wide_stage_bytes(const ExpertGemmParams& params,
                                                     const WideTile& tile) {
  constexpr uint32_t kChunkBytes = 64 * BLOCK_K * 2;
  const uint32_t b_bytes = !FormTraits<kForm>::kBMnMajor
                               ? kWideTileBBytes
                               : kChunkBytes * static_cast<uint32_t>(wide_b_chunks(params, tile));
  return tile.rows.num_tiles * kRowBoxBytes + b_bytes;
}

// The TMA loads of one K-block of a unit (gemm_loads.cuh's issue_loads, with 192 columns and one
// or two row boxes): kDownStore B = Wd rows [192 x 64] (b0); kDownGrad B = Wd MN-major (b0),
// three [64 K x 64 N] chunks; kGateUpGradStore K < I: d_g (a0) and Wg (b0), then d_u (a1) and Wu
// (b1).
template <ExpertGemmForm kForm>
__device__ __forceinline__ void issue_wide_loads(const WideMaps& maps,
                                                 const ExpertGemmParams& params,
                                                 const WideTile& tile, int row, int k_block,
                                                 __nv_bfloat16* a_dst, __nv_bfloat16* b_dst,
                                                 uint64_t* full) {
  constexpr int kChunk = 64 * BLOCK_K;  // elements of one [64 x 64] box
  int k = k_block * BLOCK_K;
  const CUtensorMap* a = maps.a0;
  const CUtensorMap* b = maps.b0;
  if constexpr (kForm == ExpertGemmForm::kGateUpGradStore) {
    if (k >= params.k_extent) {
      k -= params.k_extent;
      a = maps.a1;
      b = maps.b1;
    }
  }
  for (int t = 0; t < tile.rows.num_tiles; ++t)
    ptx::tma_load_2d(a_dst + t * kWideTileRows * BLOCK_K, a, full, k, row + t * kWideTileRows);
  const int n0 = tile.n_tile * kWideColumns<kForm>;
  if constexpr (kForm == ExpertGemmForm::kGateUpSwiGLU) {
    // 96 gate rows then 96 up rows of the weights, [96 x 64] boxes.
    ptx::tma_load_3d(b_dst, maps.b0, full, k, n0, tile.rows.expert);
    ptx::tma_load_3d(b_dst + (kWideTileN / 2) * BLOCK_K, maps.b1, full, k, n0, tile.rows.expert);
  } else if constexpr (kForm == ExpertGemmForm::kDownStore) {
    ptx::tma_load_3d(b_dst, b, full, k, n0, tile.rows.expert);
  } else {
    for (int c = 0; c < wide_b_chunks(params, tile); ++c)
      ptx::tma_load_3d(b_dst + c * kChunk, b, full, n0 + c * 64, k, tile.rows.expert);
  }
}

template <ExpertGemmForm kForm>
__global__ void __launch_bounds__(kNumThreads, 1)
    wide_tile_gemm_kernel(const __grid_constant__ CUtensorMap tmap_a0,
                          const __grid_constant__ CUtensorMap tmap_a1,
                          const __grid_constant__ CUtensorMap tmap_b0,
                          const __grid_constant__ CUtensorMap tmap_b1,
                          const __grid_constant__ CUtensorMap tmap_out,
                          const WideSwigluOutputs outs, const ExpertGemmParams params) {
  constexpr bool kBMnMajor = FormTraits<kForm>::kBMnMajor;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  WideStorage& smem = ptx::align_shared_1024<WideStorage>(smem_raw);
  int32_t* unit_start = reinterpret_cast<int32_t*>(&smem + 1);
  const WideWindow window = wide_window(params);
  if (threadIdx.x < 32) scan_row_units(params, window, unit_start);
  init_pipeline<false>(smem);  // its barrier also publishes unit_start
  const int32_t num_n_tiles = (params.n_extent + kWideColumns<kForm> - 1) / kWideColumns<kForm>;
  const int32_t num_units = unit_start[params.num_experts] * num_n_tiles;
  // K: I for the down GEMM, H for the down dgrad, 2I (d_g then d_u) for the gate/up dgrad.
  const int32_t num_k_blocks =
      (kForm == ExpertGemmForm::kGateUpGradStore ? 2 : 1) * params.k_extent / BLOCK_K;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kWideProducerRegisters>();
    // The gate/up form's fused local dispatch (dispatch_local.cuh): warps 1-3 gather the rows,
    // the TMA thread waits for each tile of a unit before its loads.
    const bool gathers = kForm == ExpertGemmForm::kGateUpSwiGLU && params.gather.x != nullptr;
    if (threadIdx.x != 0) {
      if (gathers && threadIdx.x >= 32)
        gather_rows_into_tiles(params.gather, params.header, params.row_pair,
                               gather_epoch(params.gather));
      return;
    }
    const unsigned long long epoch = gathers ? gather_epoch(params.gather) : 0;
    const WideMaps maps{&tmap_a0, &tmap_a1, &tmap_b0, &tmap_b1};
    ptx::prefetch_tensor_map(&tmap_a0);
    ptx::prefetch_tensor_map(&tmap_b0);
    PipelineState<kWideStages> state;
    // MoeConfig::gemm_lockstep_k_blocks (lockstep.h): this CTA's producer kept in step with the
    // launch's others; its one- and two-tile units take the same K-blocks, so the same ticks.
    const bool lockstep = params.lockstep.ticks != nullptr && blockIdx.x < num_units;
    LockstepCta step;
    if (lockstep)
      step = lockstep_begin(
          params.lockstep,
          lockstep_plan(params.lockstep.lead_k_blocks, num_k_blocks,
                        (num_units + static_cast<int32_t>(gridDim.x) - 1) / gridDim.x));
    int32_t local_unit = 0;
    for (int32_t unit = blockIdx.x; unit < num_units; unit += gridDim.x, ++local_unit) {
      const WideTile tile = wide_tile(params, window, unit_start, num_n_tiles, unit);
      const int row = tile.rows.m_tile * kWideTileRows - params.macrobatch.ring_row_base;
      const uint32_t bytes = wide_stage_bytes<kForm>(params, tile);
      if (gathers)
        for (int t = 0; t < tile.rows.num_tiles; ++t)
          wait_for_gathered_tile(params.wait, params.gather, tile.rows.m_tile + t, epoch);
      for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
        if (lockstep) lockstep_k_block(params.lockstep, step, params.wait, local_unit, k_block);
        produce_stage(params.wait, smem, state, bytes,
                      [&](__nv_bfloat16* a_dst, __nv_bfloat16* b_dst, uint64_t* full) {
                        issue_wide_loads<kForm>(maps, params, tile, row, k_block, a_dst, b_dst,
                                                full);
                      });
      }
    }
    if (lockstep) lockstep_end(params.lockstep, step, local_unit);
    return;
  }
  ptx::setmaxnreg_inc<kWideConsumerRegisters>();
  const int consumer_idx = warpgroup - 1;
  const bool issuer = threadIdx.x == 128;  // consumer 0's first thread: the TMA stores
  PipelineState<kWideStages> state;
  float acc0[96], acc1[96];
  for (int32_t unit = blockIdx.x; unit < num_units; unit += gridDim.x) {
    const WideTile tile = wide_tile(params, window, unit_start, num_n_tiles, unit);
    if (tile.rows.num_tiles == 2)
      consume_wide_tile<true, kBMnMajor>(params.wait, smem, state, num_k_blocks, consumer_idx, acc0,
                                         acc1);
    else
      consume_wide_tile<false, kBMnMajor>(params.wait, smem, state, num_k_blocks, consumer_idx,
                                          acc0, acc1);
    // Output rows: y and dx are full size (out_row_base 0); h, g, u and dh_raw sit in the
    // macrobatch's ring.
    const int row = tile.rows.m_tile * kWideTileRows - params.macrobatch.out_row_base;
    if constexpr (kForm == ExpertGemmForm::kGateUpSwiGLU)
      wide_epilogue(smem, tile, consumer_idx, issuer, acc0, acc1,
                    [&](const char* staging, int row_offset, int thread, int threads) {
                      copy_out_swiglu(outs, params, staging, row + row_offset,
                                      tile.n_tile * kWideColumns<kForm>, thread, threads);
                    });
    else
      wide_epilogue(smem, tile, consumer_idx, issuer, acc0, acc1,
                    [&](const char* staging, int row_offset, int thread, int) {
                      if (thread == 0)
                        store_wide(&tmap_out, staging, tile.n_tile, params.n_extent,
                                   row + row_offset);
                    });
  }
  // Outstanding TMA stores read the staging tile: it must outlive them.
  if (issuer) ptx::bulk_wait_group<0>();
}

template <ExpertGemmForm kForm>
cudaError_t launch_wide_form(const WideGemmMaps& maps, const ExpertGemmParams& params, int num_ctas,
                             cudaStream_t stream) {
  auto* kernel = &wide_tile_gemm_kernel<kForm>;
  const size_t most_bytes =
      sizeof(WideStorage) + 1024 + (kMaxWideTileExperts + 1) * sizeof(int32_t);
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(most_bytes));
  if (status != cudaSuccess) return status;
  const size_t smem_bytes = sizeof(WideStorage) + 1024 + (params.num_experts + 1) * sizeof(int32_t);
  kernel<<<num_ctas, kNumThreads, smem_bytes, stream>>>(maps.a0, maps.a1, maps.b0, maps.b1,
                                                        maps.out, maps.swiglu, params);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_wide_tile_gemm(ExpertGemmForm form, const WideGemmMaps& maps,
                                  const ExpertGemmParams& params, int num_ctas,
                                  cudaStream_t stream) {
  if (params.num_experts > kMaxWideTileExperts || params.k_extent % BLOCK_K != 0)
    return cudaErrorInvalidValue;
  switch (form) {
    case ExpertGemmForm::kGateUpSwiGLU:
      return launch_wide_form<ExpertGemmForm::kGateUpSwiGLU>(maps, params, num_ctas, stream);
    case ExpertGemmForm::kDownStore:
      return launch_wide_form<ExpertGemmForm::kDownStore>(maps, params, num_ctas, stream);
    case ExpertGemmForm::kDownGrad:
      return launch_wide_form<ExpertGemmForm::kDownGrad>(maps, params, num_ctas, stream);
    case ExpertGemmForm::kGateUpGradStore:
      return launch_wide_form<ExpertGemmForm::kGateUpGradStore>(maps, params, num_ctas, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload(
    "wide_tile_gemm.cu", {kernel_symbol(&wide_tile_gemm_kernel<ExpertGemmForm::kGateUpSwiGLU>),
                          kernel_symbol(&wide_tile_gemm_kernel<ExpertGemmForm::kDownStore>),
                          kernel_symbol(&wide_tile_gemm_kernel<ExpertGemmForm::kDownGrad>),
                          kernel_symbol(&wide_tile_gemm_kernel<ExpertGemmForm::kGateUpGradStore>)});
}  // namespace

}  // namespace mok::kernels
