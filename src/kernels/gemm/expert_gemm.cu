// The expert grouped GEMM kernel, every form of the layer (forms and operands in
// expert_gemm_params.h, epilogues in epilogue.cuh, the mainloop and warp roles in
// gemm_mainloop.cuh).
//
// Grid: persistent, one 384-thread CTA per SM. CTA c takes tiles c, c + grid, c + 2*grid, ...;
// the producer and both consumers walk the same sequence, so no tile handoff is needed.
// Tiles:
//   row-tile forms  (m, n) with m over the schedule's 128-row tiles (each inside one expert
//                   segment) and n over output columns; tile t maps to a group of kTileGroupM
//                   consecutive m-tiles (about one expert) swept n-major, so CTAs running
//                   together share the B tiles of one expert and the A rows of the group in L2.
//   kWeightGrad     (expert, m, n) over each expert's [M, N] output, K = the expert's rows.
// Fused local dispatch (kGateUpSwiGLU with params.gather.x set): the producer warpgroup's warps
// 1-3 gather the routed x rows while warp 0's TMA thread waits per tile for its rows
// (dispatch_local.cuh), so the gather overlaps the GEMM instead of running before it. kDownGrad
// the same with the d_out rows (the expert-parallel backward's pull, ep_exchange.cpp).
// Producer loads per K-block of 64: gemm_loads.cuh (shared with the persistent kernels).
// Every form's output leaves through the shared-memory staging tile and TMA stores
// (epilogue.cuh), overlapping the next tile's mainloop; the tile costs the ring its fourth stage
// (kFourStages, MoeConfig::gemm_four_stages: a tile of half the columns, stored in two rounds,
// and four stages). kDownGradSwiGLU instead runs the SwiGLU backward in its epilogue, through a
// ring of subtiles that producer warp 1 loads and producer warp 2 stores (dgated_epilogue.cuh).
// CTA pairs (kPaired, MoeConfig::gemm_cta_pairs): clusters of two CTAs walk "pair tiles", two
// row tiles 2p and 2p + 1 (row-tile forms: of the same column tile; kWeightGrad: of the same
// expert and column tile), one per CTA. Where both tiles read the same B (the same expert), each
// CTA loads half of B and multicasts it to both (gemm_loads.cuh): 32 KB of L2 reads per CTA and
// K-block instead of 48. A stage is reused once both CTAs' consumers released it (each consumer
// warp arrives on its own and its peer's empty barrier), so the pair runs in lockstep; a CTA
// whose tile does not exist (an odd tile count) passes the stages empty ("phantom").
#include <cuda.h>
#include <cuda_bf16.h>

#include <type_traits>

#include "kernels/common/kernel_preload.h"
#include "kernels/common/macrobatch.h"
#include "kernels/common/overlapped_launch.h"
#include "kernels/gemm/dgated_epilogue.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_loads.cuh"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/gemm/launch.h"
#include "kernels/gemm/tile_walk.h"
#include "kernels/gemm/weight_grad_segments.cuh"
#include "kernels/persistent/task_order.h"
#include "kernels/persistent/task_queue.cuh"
#include "kernels/stages/dispatch_local.cuh"

namespace mok::kernels {

namespace {

struct TileSpace {
  int m_begin;  // row-tile forms: the first row tile of the launch's macrobatch
  int num_m_tiles;
  int num_n_tiles;
  int m_units;    // per column tile (and expert): num_m_tiles, or with pairs their pair count
  int num_units;  // the tiles (or pair tiles) the grid walks
};

template <ExpertGemmForm kForm, bool kPaired>
__device__ __forceinline__ TileSpace tile_space(const ExpertGemmParams& params) {
  using Traits = FormTraits<kForm>;
  TileSpace space;
  space.num_n_tiles = (params.n_extent + Traits::kTileN - 1) / Traits::kTileN;
  if constexpr (Traits::kRowTiles) {
    const int filled = params.header->num_tiles;
    const int begin = min(params.macrobatch.tile_begin, filled);
    space.m_begin = begin;
    space.num_m_tiles = min(params.macrobatch.tile_end, filled) - begin;
  } else {
    space.m_begin = 0;
    space.num_m_tiles = (params.m_extent + BLOCK_M - 1) / BLOCK_M;
  }
  space.m_units = kPaired ? (space.num_m_tiles + 1) / 2 : space.num_m_tiles;
  space.num_units =
      space.m_units * space.num_n_tiles * (Traits::kRowTiles ? 1 : params.num_experts);
  return space;
}

static_assert(sizeof(GemmSharedStorage<kNumStages>) + 1024 +
                      kMaxSharedExperts * sizeof(SegmentRows) <=
                  227 * 1024,
              "the segment rows fit beside the ring and the staging tile");

// The coordinates of the tile at row tile `m_local` (of the launch's row tiles, or of M),
// column tile `n_tile` and, for kWeightGrad, expert `expert`.
template <ExpertGemmForm kForm>
__device__ __forceinline__ TileCoord tile_coord_at(const ExpertGemmParams& params,
                                                   const TileSpace& space, int m_local, int n_tile,
                                                   int expert, const SegmentRows* shared_rows) {
  TileCoord coord;
  coord.n_tile = n_tile;
  if constexpr (FormTraits<kForm>::kRowTiles) {
    coord.m_tile = m_local + space.m_begin;
    coord.expert = params.tile_expert[coord.m_tile];
    coord.k_row0 = 0;
    const int k_total =
        kForm == ExpertGemmForm::kGateUpGradStore ? 2 * params.k_extent : params.k_extent;
    coord.num_k_blocks = k_total / BLOCK_K;
  } else {
    coord.expert = expert;
    coord.m_tile = m_local;
    const SegmentRows segment = segment_rows(params, shared_rows, expert);
    const int segment_begin = segment.begin;
    const int segment_end = segment.end;
    if (params.macrobatch.rows > 0) {
      // This macrobatch's share of the expert's rows, read from the ring (macrobatch.h).
      const WeightGradSlice slice = weight_grad_slice(
          segment_begin, segment_end, params.macrobatch.index, params.macrobatch.rows);
      coord.skip = !slice.active;
      coord.k_row0 = static_cast<int>(slice.k_begin) - params.macrobatch.ring_row_base;
      coord.num_k_blocks =
          slice.active ? static_cast<int>(slice.k_end - slice.k_begin) / BLOCK_K : 0;
      coord.load_slot = slice.load_partial ? slice.load_slot : -1;
      coord.store_slot = slice.store_final ? -1 : slice.store_slot;
    } else {
      coord.k_row0 = segment_begin;
      coord.num_k_blocks = (segment_end - segment_begin) / BLOCK_K;
    }
  }
  return coord;
}

// MoeConfig::gemm_expert_aligned_groups (tile_walk.h): the experts of the CTA's walk's row tiles,
// for groups that start where an expert does; null for groups of exactly params.tile_group.
template <ExpertGemmForm kForm, bool kPaired>
__device__ __forceinline__ const int32_t* aligned_tile_expert(const ExpertGemmParams& params,
                                                              const TileSpace& space,
                                                              const CtaWalk& cta) {
  if constexpr (!FormTraits<kForm>::kRowTiles || kPaired) {
    return nullptr;
  } else {
    return params.expert_aligned_groups ? params.tile_expert + space.m_begin + cta.m_lo : nullptr;
  }
}

// One CTA's tile of walk unit `unit`: with pairs, the row tile of its rank in the pair tile,
// whether that tile exists (not: a phantom with its partner's K-blocks) and whether the pair
// reads the same B (then multicast). Row-tile forms group the units params.tile_group row tiles
// (or pairs) at a time, swept n-major (task_order.h); kWeightGrad walks expert by expert, m
// fastest.
struct UnitTile {
  TileCoord coord;
  bool phantom = false;
  bool shares_b = false;
};

template <ExpertGemmForm kForm, bool kPaired>
__device__ __forceinline__ UnitTile unit_tile(const ExpertGemmParams& params,
                                              const TileSpace& space, const CtaWalk& cta, int unit,
                                              int rank, const SegmentRows* shared_rows) {
  constexpr bool kRowTiles = FormTraits<kForm>::kRowTiles;
  WalkUnit walk = walk_unit(unit, cta.m_units, space.num_n_tiles, kRowTiles, params.tile_group,
                            aligned_tile_expert<kForm, kPaired>(params, space, cta));
  walk.m_unit += cta.m_lo;
  UnitTile tile;
  if constexpr (!kPaired) {
    tile.coord =
        tile_coord_at<kForm>(params, space, walk.m_unit, walk.n_tile, walk.expert, shared_rows);
  } else {
    const PairRow row = pair_row(walk.m_unit, rank, space.num_m_tiles);
    tile.phantom = row.phantom;
    tile.coord =
        tile_coord_at<kForm>(params, space, row.m_tile, walk.n_tile, walk.expert, shared_rows);
    const int first = 2 * walk.m_unit;
    if constexpr (kRowTiles)
      tile.shares_b = row.partner_exists && params.tile_expert[space.m_begin + first] ==
                                                params.tile_expert[space.m_begin + first + 1];
    else
      tile.shares_b = row.partner_exists;  // one expert's [M, N]: the same B rows
  }
  return tile;
}

// A weight-gradient tile's fp32 accumulator between two macrobatches: each consumer thread's 128
// values, contiguous (this layout is private to the store and the load of the same tile).
__device__ __forceinline__ float* partial_tile(float* slot, const TileCoord& coord,
                                               const TileSpace& space) {
  const int64_t tile = static_cast<int64_t>(coord.n_tile) * space.num_m_tiles + coord.m_tile;
  return slot + (tile * kConsumerThreads + (threadIdx.x - BLOCK_M)) * 128;
}
__device__ __forceinline__ void load_partial(float (&acc)[128], const float* values) {
#pragma unroll
  for (int q = 0; q < 32; ++q) {
    const float4 v = reinterpret_cast<const float4*>(values)[q];
    acc[4 * q] = v.x;
    acc[4 * q + 1] = v.y;
    acc[4 * q + 2] = v.z;
    acc[4 * q + 3] = v.w;
  }
}
__device__ __forceinline__ void store_partial(const float (&acc)[128], float* values) {
#pragma unroll
  for (int q = 0; q < 32; ++q)
    reinterpret_cast<float4*>(values)[q] =
        make_float4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2], acc[4 * q + 3]);
}

// Every form's epilogue leaves through the staging tile, which costs one stage of the ring.
using FormStorage = GemmSharedStorage<kNumStages>;
// The four-stage ring (kFourStages, MoeConfig::gemm_four_stages): a staging tile of 128 columns
// (epilogue.cuh's store_round, two rounds per tile) makes room for a fourth stage, so two stages
// load while the consumers hold two (docs/design.md, "What sets the row-tile GEMMs' time").
using FourStageStorage = GemmSharedStorage<kNumStages + 1, BLOCK_M, BLOCK_N, BLOCK_M, BLOCK_N / 2>;
static_assert(sizeof(FourStageStorage) + 1024 <= 227 * 1024, "four stages fit beside the tile");
// The units' queue lives in the storage's tail padding: four stages with their alignment slack
// and the kernel's static shared memory fill the 227 KB to the byte (session 23: a queue after
// the storage made the four-stage launch ask 96 bytes too many).
static_assert(sizeof(TaskQueue<QueuedUnit>) <= kStorageTailBytes, "the units' queue fits the tail");
static_assert(kTailInPadding<FourStageStorage> && kTailInPadding<FormStorage>,
              "the tail costs no room");
template <ExpertGemmForm kForm>
constexpr bool kDgated = kForm == ExpertGemmForm::kDownGradSwiGLU;
template <ExpertGemmForm kForm, bool kFourStages>
using StorageOf =
    std::conditional_t<kDgated<kForm>, DgatedSharedStorage,
                       std::conditional_t<kFourStages, FourStageStorage, FormStorage>>;
// The SwiGLU epilogue's subtile ring takes the room a fourth stage would.
template <ExpertGemmForm kForm>
constexpr bool kHasFourStages = FormTraits<kForm>::kRowTiles && !kDgated<kForm>;

// Which forms can run 64-row tiles: the row-tile forms, not in CTA pairs (whose two CTAs walk
// one stage sequence). The forward's (B K-major) run them with params.half_row_tiles; the dgrads'
// (B MN-major) only with params.dgrad_half_row_tiles (MoeConfig::gemm_dgrad_half_row_tiles):
// there a 64-row tile finishes its K loop in half the time of its expert's 128-row tile on the
// same B columns, so free-running the two stop sharing B through L2 (the down dgrad at
// `dsv3_e128` ran 20% slower, docs/perf.md, session 13), which the lockstep may prevent.
// Not kDownGradSwiGLU, whose epilogue walks 128-row subtiles.
template <ExpertGemmForm kForm, bool kPaired>
constexpr bool kHalfRowTiles = FormTraits<kForm>::kRowTiles && !kPaired && !kDgated<kForm>;

// Whether the row tile of walk unit `unit` runs at 64 rows: segments start at multiples of 128
// and end in padding, so the tile holds at most 64 routed rows exactly when its row 64 is
// padding. Only the consumers ask (the producer loads the same boxes either way), a tile ahead,
// so the load's latency hides under the current tile.
template <ExpertGemmForm kForm, bool kPaired>
__device__ __forceinline__ bool half_row_tile(const ExpertGemmParams& params,
                                              const TileSpace& space, const CtaWalk& cta,
                                              int unit) {
  if constexpr (!kHalfRowTiles<kForm, kPaired>) {
    return false;
  } else {
    const int32_t enabled =
        FormTraits<kForm>::kBMnMajor ? params.dgrad_half_row_tiles : params.half_row_tiles;
    if (!enabled || unit >= cta.num_units) return false;
    const WalkUnit walk = walk_unit(unit, cta.m_units, space.num_n_tiles, true, params.tile_group,
                                    aligned_tile_expert<kForm, kPaired>(params, space, cta));
    const int64_t m_tile = walk.m_unit + cta.m_lo + space.m_begin;
    return params.row_pair[m_tile * BLOCK_M + BLOCK_M / 2] < 0;
  }
}

// The most units any CTA of the launch walks (MoeConfig::gemm_lockstep_k_blocks: the ticks a
// CTA may wait on): CTA 0 of the walk's stride, or under the L2 placement of either half's.
__device__ __forceinline__ int32_t most_units_of_a_cta(const ExpertGemmParams& params,
                                                       const TileSpace& space, const CtaWalk& cta,
                                                       bool placed) {
  const auto ceil_units = [](const CtaWalk& walk) {
    return walk.stride > 0 ? (walk.num_units + walk.stride - 1) / walk.stride : 0;
  };
  if (!placed) return ceil_units(cta);
  const int32_t grid = static_cast<int32_t>(gridDim.x);
  const CtaWalk lower =
      l2_half_walk(0, grid, params.l2.lower_slots, space.m_units, space.num_n_tiles);
  const CtaWalk upper = l2_half_walk(params.l2.lower_slots, grid, params.l2.lower_slots,
                                     space.m_units, space.num_n_tiles);
  return max(params.l2.lower_slots > 0 ? ceil_units(lower) : 0,
             params.l2.lower_slots < grid ? ceil_units(upper) : 0);
}

// kResumes (kWeightGrad only): the launch may continue tiles from fp32 partials of an earlier
// macrobatch. A separate instantiation because loading the partial into the accumulator (a
// non-wgmma definition of its registers) makes ptxas serialize every wgmma of the kernel (C7515):
// that cost the one-macrobatch weight gradients 11% (4.85 -> 5.38 ms at dsv3_local). Only
// launches for macrobatches after the first can resume, and only they pay it.
// kPaired: launched in clusters of two CTAs (CTA pairs, above). kFourStages: the four-stage ring
// (FourStageStorage), the row-tile forms alone.
template <ExpertGemmForm kForm, bool kResumes = false, bool kPaired = false,
          bool kFourStages = false, bool kByTicket = false>
__global__ void __launch_bounds__(kNumThreads, 1) expert_gemm_kernel(
    const __grid_constant__ CUtensorMap tmap_a0, const __grid_constant__ CUtensorMap tmap_a1,
    const __grid_constant__ CUtensorMap tmap_b0, const __grid_constant__ CUtensorMap tmap_b1,
    const __grid_constant__ CUtensorMap tmap_out, const __grid_constant__ CUtensorMap tmap_out2,
    const __grid_constant__ CUtensorMap tmap_out3, const ExpertGemmParams params) {
  using Traits = FormTraits<kForm>;
  static_assert(!kFourStages || (kHasFourStages<kForm> && !kPaired && !kResumes),
                "four stages: the row-tile forms, without CTA pairs");
  static_assert(!kByTicket || (Traits::kRowTiles && !kPaired && !kResumes),
                "units by ticket: the row-tile forms, without CTA pairs");
  static_assert(!kDgated<kForm> || (!kPaired && !kByTicket),
                "the SwiGLU epilogue's loader walks the static walk's units alone");
  // Launched overlapped (MoeConfig::overlap_kernel_launches), the CTA may be here while the
  // previous kernel still runs: nothing below touches memory before it has completed.
  ptx::begin_after_previous_kernel();
  using Storage = StorageOf<kForm, kFourStages>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Storage& smem = ptx::align_shared_1024<Storage>(smem_raw);
  const SegmentRows* shared_rows = nullptr;
  if constexpr (!Traits::kRowTiles)  // visible after init_pipeline's barrier
    shared_rows = copy_segment_rows(params, reinterpret_cast<SegmentRows*>(&smem + 1));
  // MoeConfig::gemm_l2_placement: this CTA's slot, claimed by thread 0 (l2_placement.h).
  constexpr bool kCanPlace = Traits::kRowTiles && !kPaired;
  __shared__ int32_t l2_slot;
  if constexpr (kCanPlace) {
    if (params.l2.slot_of_sm != nullptr && threadIdx.x == 0) l2_slot = claim_l2_slot(params.l2);
  }
  // MoeConfig::gemm_tiles_by_ticket (tile_tickets.h): the units by ticket, handed from the
  // producer to the consumers through a queue in the storage's tail bytes.
  // A separate instantiation (kByTicket), so that the static walk's registers stay as they were
  // (in one kernel for both, ptxas spilled in the default forms).
  [[maybe_unused]] auto& unit_queue = *reinterpret_cast<TaskQueue<QueuedUnit>*>(smem.tail_bytes);
  if constexpr (kByTicket) {
    if (threadIdx.x == 0) unit_queue.init();
  }
  if constexpr (kDgated<kForm>) {
    if (threadIdx.x == 0) init_dgated_barriers(smem);
  }
  init_pipeline<kPaired>(smem);  // its barrier publishes l2_slot (and the queue's barriers)
  const TileSpace space = tile_space<kForm, kPaired>(params);
  const int warpgroup = threadIdx.x / 128;
  // The walk: CTA c takes units c, c + grid, ...; a pair (clusters of two along x) its units
  // together, one tile per rank; under the L2 placement, its partition's share by slot.
  const int rank = kPaired ? static_cast<int>(ptx::cluster_cta_rank()) : 0;
  CtaWalk cta{static_cast<int32_t>(kPaired ? blockIdx.x / 2 : blockIdx.x),
              static_cast<int32_t>(kPaired ? gridDim.x / 2 : gridDim.x), 0, space.m_units,
              space.num_units};
  if constexpr (kCanPlace) {
    if (params.l2.slot_of_sm != nullptr)
      cta = l2_half_walk(l2_slot, static_cast<int32_t>(gridDim.x), params.l2.lower_slots,
                         space.m_units, space.num_n_tiles);
  }

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    // The forward's x rows, or the backward's d_out rows (the expert-parallel pull).
    constexpr bool kCanGather =
        kForm == ExpertGemmForm::kGateUpSwiGLU || kForm == ExpertGemmForm::kDownGrad;
    const bool gathers = kCanGather && params.gather.x != nullptr;
    if (threadIdx.x == 0) {
      ptx::prefetch_tensor_map(&tmap_a0);
      ptx::prefetch_tensor_map(&tmap_b0);
      const unsigned long long epoch = gathers ? gather_epoch(params.gather) : 0;
      PipelineState<Storage::kNumStagesHere> state;
      // MoeConfig::gemm_lockstep_k_blocks: the row-tile forms' producers kept in step
      // (lockstep.h; not in CTA pairs, which run their two CTAs in step already), begun at the
      // CTA's first unit, whose K-blocks every unit of the launch has.
      const bool lockstep =
          Traits::kRowTiles && !kPaired && !kByTicket && params.lockstep.ticks != nullptr;
      LockstepCta step;
      int32_t local_unit = 0;
      // By ticket: each unit handed to the consumers with its 64-row flag, the next ticket taken
      // at once (its round trip passes under this unit's loads).
      const unsigned long long base = kByTicket ? ticket_base(params.tickets) : 0;
      int next_unit = kByTicket ? take_unit(params.tickets, base, cta.num_units) : cta.first;
      for (int unit = next_unit;; unit = kByTicket ? next_unit : unit + cta.stride, ++local_unit) {
        if constexpr (kByTicket) {
          const bool half = half_row_tile<kForm, kPaired>(params, space, cta, unit);
          unit_queue.publish(params.wait, static_cast<uint32_t>(local_unit), {unit, half ? 1 : 0});
          if (unit < cta.num_units) next_unit = take_unit(params.tickets, base, cta.num_units);
        }
        if (unit >= cta.num_units) break;
        const UnitTile tile =
            unit_tile<kForm, kPaired>(params, space, cta, unit, rank, shared_rows);
        const TileCoord& coord = tile.coord;
        if (coord.skip) continue;  // kWeightGrad: no rows in this macrobatch (both of a pair)
        if (lockstep && local_unit == 0)
          step = lockstep_begin(
              params.lockstep,
              lockstep_plan(params.lockstep.lead_k_blocks, coord.num_k_blocks,
                            most_units_of_a_cta(params, space, cta,
                                                kCanPlace && params.l2.slot_of_sm != nullptr)));
        const auto in_step = [&](int k_block) {
          if (lockstep) lockstep_k_block(params.lockstep, step, params.wait, local_unit, k_block);
        };
        if (tile.phantom) {
          for (int k_block = 0; k_block < coord.num_k_blocks; ++k_block) {
            in_step(k_block);
            produce_stage(params.wait, smem, state, 0,
                          [](__nv_bfloat16*, __nv_bfloat16*, uint64_t*) {});
          }
          continue;
        }
        if (gathers) wait_for_gathered_tile(params.wait, params.gather, coord.m_tile, epoch);
        if (params.ablation == GemmAblation::kNoLoads) {
          for (int k_block = 0; k_block < coord.num_k_blocks; ++k_block) {
            in_step(k_block);
            produce_stage(params.wait, smem, state, 0,
                          [](__nv_bfloat16*, __nv_bfloat16*, uint64_t*) {});
          }
          continue;
        }
        const PairLoad pair{static_cast<uint16_t>(tile.shares_b ? 0b11 : 0), rank};
        for (int k_block = 0; k_block < coord.num_k_blocks; ++k_block) {
          in_step(k_block);
          produce_stage(params.wait, smem, state, kTileABytes + kTileBBytes,
                        [&](__nv_bfloat16* a_dst, __nv_bfloat16* b_dst, uint64_t* full) {
                          issue_loads<kForm>(&tmap_a0, &tmap_a1, &tmap_b0, &tmap_b1, params, coord,
                                             k_block, a_dst, b_dst, full, pair);
                        });
        }
      }
      if (lockstep) lockstep_end(params.lockstep, step, local_unit);
    } else if (kDgated<kForm> && (threadIdx.x == 32 || threadIdx.x == 64)) {
      // kDownGradSwiGLU's loader (warp 1) and storer (warp 2), each over the CTA's tiles.
      if constexpr (kDgated<kForm>) {
        const bool loader = threadIdx.x == 32;
        if (loader) {
          ptx::prefetch_tensor_map(&tmap_a1);
          ptx::prefetch_tensor_map(&tmap_b1);
        }
        PipelineState<kDgatedBuffers> subtiles;
        for (int unit = cta.first; unit < cta.num_units; unit += cta.stride) {
          const TileCoord coord =
              unit_tile<kForm, kPaired>(params, space, cta, unit, rank, shared_rows).coord;
          if (loader)
            load_dgated_tile(&tmap_a1, &tmap_b1, params, smem, subtiles, coord);
          else
            store_dgated_subtiles({&tmap_out, &tmap_out2, &tmap_out3}, params, smem, subtiles,
                                  coord);
        }
        if (!loader) ptx::bulk_wait_group<0>();  // the stores' writes, before the kernel ends
      }
    } else if (gathers && threadIdx.x >= 32) {
      gather_rows_into_tiles(params.gather, params.header, params.row_pair,
                             gather_epoch(params.gather));
    }
  } else {
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    const int consumer_idx = warpgroup - 1;
    PipelineState<Storage::kNumStagesHere> state;
    [[maybe_unused]] PipelineState<kDgatedBuffers> subtiles;  // kDownGradSwiGLU's epilogue ring
    float acc[128];
    // The static walk reads the next unit's 64-row flag a unit ahead; by ticket the producer
    // hands each unit with its flag.
    bool half_next = !kByTicket && half_row_tile<kForm, kPaired>(params, space, cta, cta.first);
    uint32_t units_read = 0;
    for (int unit = cta.first;; unit += kByTicket ? 0 : cta.stride) {
      bool half = half_next;
      if constexpr (kByTicket) {
        const QueuedUnit queued = unit_queue.read(params.wait, units_read++);
        unit = queued.unit;
        half = queued.half != 0;
      }
      if (unit >= cta.num_units) break;
      const UnitTile tile = unit_tile<kForm, kPaired>(params, space, cta, unit, rank, shared_rows);
      TileCoord coord = tile.coord;
      coord.half = half;
      if (!kByTicket)
        half_next = half_row_tile<kForm, kPaired>(params, space, cta, unit + cta.stride);
      if (coord.skip) continue;  // kWeightGrad: the expert has no rows in this macrobatch
      if constexpr (kPaired) {
        if (tile.phantom) {
          pass_stages<true>(params.wait, smem, state, coord.num_k_blocks);
          continue;
        }
      }
      // kWeightGrad across a macrobatch boundary.
      const bool resumes = kResumes && coord.load_slot >= 0;
      if constexpr (kResumes) {
        if (resumes)
          load_partial(acc, partial_tile(params.macrobatch.partial[coord.load_slot], coord, space));
      }
      [[maybe_unused]] DgatedRows dgated_rows_of_tile;
      if constexpr (kDgated<kForm>) dgated_rows_of_tile = dgated_pairs(params, coord, consumer_idx);
      if (params.ablation == GemmAblation::kNoMath)
        pass_stages<kPaired>(params.wait, smem, state, coord.num_k_blocks);
      else if (coord.half)
        consume_tile<false, Traits::kBMnMajor, false, true>(params.wait, smem, state,
                                                            coord.num_k_blocks, consumer_idx, acc);
      else
        consume_tile<Traits::kAMnMajor, Traits::kBMnMajor, kPaired>(
            params.wait, smem, state, coord.num_k_blocks, consumer_idx, acc, resumes);
      if constexpr (kDgated<kForm>)
        dgated_epilogue(smem, params, coord, consumer_idx, acc, dgated_rows_of_tile, subtiles);
      else if (coord.store_slot >= 0)
        store_partial(acc, partial_tile(params.macrobatch.partial[coord.store_slot], coord, space));
      else
        store_tile<kForm>({&tmap_out, &tmap_out2, &tmap_out3}, smem, params, coord, consumer_idx,
                          acc);
    }
    // Outstanding TMA stores read the staging tile: it must outlive them.
    if (threadIdx.x == BLOCK_M) ptx::bulk_wait_group<0>();
  }
  // The peer may still arrive on this CTA's barriers until its last stage: both leave together.
  if constexpr (kPaired) ptx::cluster_sync();
}

template <ExpertGemmForm kForm, bool kResumes, bool kPaired, bool kFourStages = false,
          bool kByTicket = false>
cudaError_t launch_form(const ExpertGemmMaps& maps, const ExpertGemmParams& params, int num_ctas,
                        KernelStream on) {
  size_t smem_bytes = sizeof(StorageOf<kForm, kFourStages>) + 1024;
  if (!FormTraits<kForm>::kRowTiles && segments_in_shared(params.num_experts))
    smem_bytes += static_cast<size_t>(params.num_experts) * sizeof(SegmentRows);
  auto* kernel = &expert_gemm_kernel<kForm, kResumes, kPaired, kFourStages, kByTicket>;
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem_bytes));
  if (status != cudaSuccess) return status;
  int grid = num_ctas;
  if constexpr (kPaired) {
    // Persistent: as many pairs as fit at once (a GPC with an odd number of free SMs leaves
    // one out). Asked once per kernel (one GPU model per process is assumed).
    static int max_clusters = -1;
    if (max_clusters < 0) {
      cudaLaunchAttribute cluster{};
      cluster.id = cudaLaunchAttributeClusterDimension;
      cluster.val.clusterDim.x = 2;
      cluster.val.clusterDim.y = 1;
      cluster.val.clusterDim.z = 1;
      cudaLaunchConfig_t config{};
      config.gridDim = dim3(2 * (num_ctas / 2));
      config.blockDim = dim3(kNumThreads);
      config.dynamicSmemBytes = smem_bytes;
      config.stream = on.stream;
      config.attrs = &cluster;
      config.numAttrs = 1;
      status = cudaOccupancyMaxActiveClusters(&max_clusters, kernel, &config);
      if (status != cudaSuccess) return status;
    }
    const int pairs = max_clusters < num_ctas / 2 ? max_clusters : num_ctas / 2;
    if (pairs < 1) return launch_form<kForm, kResumes, false>(maps, params, num_ctas, on);
    grid = 2 * pairs;
  }
  return launch_maybe_overlapped(kernel, grid, kNumThreads, smem_bytes, on, kPaired ? 2 : 1,
                                 maps.a0, maps.a1, maps.b0, maps.b1, maps.out, maps.out2, maps.out3,
                                 params);
}

template <ExpertGemmForm kForm, bool kResumes = false>
cudaError_t launch_either(const ExpertGemmMaps& maps, const ExpertGemmParams& params, int num_ctas,
                          bool cta_pairs, KernelStream on) {
  if (cta_pairs) return launch_form<kForm, kResumes, true>(maps, params, num_ctas, on);
  if constexpr (kHasFourStages<kForm> && !kResumes) {
    // The two-round epilogue stages 128 columns at a time; the push reads whole rows.
    const bool by_ticket = params.tickets.counter != nullptr;
    if (params.four_stages && params.push.slot_peers == nullptr)
      return by_ticket ? launch_form<kForm, false, false, true, true>(maps, params, num_ctas, on)
                       : launch_form<kForm, false, false, true>(maps, params, num_ctas, on);
    if (by_ticket) return launch_form<kForm, false, false, false, true>(maps, params, num_ctas, on);
  }
  return launch_form<kForm, kResumes, false>(maps, params, num_ctas, on);
}

}  // namespace

cudaError_t launch_expert_gemm(ExpertGemmForm form, const ExpertGemmMaps& maps,
                               const ExpertGemmParams& params, int num_ctas, bool cta_pairs,
                               KernelStream on) {
  using Form = ExpertGemmForm;
  switch (form) {
    case Form::kGateUpSwiGLU:
      return launch_either<Form::kGateUpSwiGLU>(maps, params, num_ctas, cta_pairs, on);
    case Form::kDownStore:
      return launch_either<Form::kDownStore>(maps, params, num_ctas, cta_pairs, on);
    case Form::kGateUpStore:
      return launch_either<Form::kGateUpStore>(maps, params, num_ctas, cta_pairs, on);
    case Form::kDownGrad:
      return launch_either<Form::kDownGrad>(maps, params, num_ctas, cta_pairs, on);
    case Form::kGateUpGradStore:
      return launch_either<Form::kGateUpGradStore>(maps, params, num_ctas, cta_pairs, on);
    case Form::kDownGradSwiGLU:
      // One form: no pairs, four stages, 64-row tiles or tickets (MoeConfig::
      // swiglu_backward_in_dgrad says why); the lockstep and the L2 placement still apply.
      return launch_form<Form::kDownGradSwiGLU, false, false>(maps, params, num_ctas, on);
    case Form::kWeightGrad:
      if (params.weight_grad_pingpong && params.macrobatch.rows == 0 && !cta_pairs)
        return launch_weight_grad_pingpong(maps, params, num_ctas, on.stream);
      // Macrobatch 0 (and a single macrobatch) starts every tile from zero.
      if (params.macrobatch.rows > 0 && params.macrobatch.index > 0)
        return launch_either<Form::kWeightGrad, true>(maps, params, num_ctas, cta_pairs, on);
      return launch_either<Form::kWeightGrad>(maps, params, num_ctas, cta_pairs, on);
  }
  return cudaErrorInvalidValue;
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload(
    "expert_gemm.cu",
    {kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpSwiGLU>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpSwiGLU, false, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kDownStore, false, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpStore, false, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kDownGrad, false, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpGradStore, false, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpSwiGLU, false, false, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kDownStore, false, false, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpStore, false, false, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kDownGrad, false, false, false, true>),
     kernel_symbol(
         &expert_gemm_kernel<ExpertGemmForm::kGateUpGradStore, false, false, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpSwiGLU, false, false, true, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kDownStore, false, false, true, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpStore, false, false, true, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kDownGrad, false, false, true, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpGradStore, false, false, true, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpSwiGLU, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kDownStore, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kDownGrad, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpGradStore, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kWeightGrad, false, true>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kDownStore>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpStore>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kDownGrad>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kDownGradSwiGLU>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kGateUpGradStore>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kWeightGrad>),
     kernel_symbol(&expert_gemm_kernel<ExpertGemmForm::kWeightGrad, true>)});
}  // namespace

}  // namespace mok::kernels
