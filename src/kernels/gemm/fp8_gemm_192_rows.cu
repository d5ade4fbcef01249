// The FP8 row-tile GEMM in 192 x 128 tiles (fp8_gemm.h's kRowTiles with tile_rows = 192;
// MoeConfig::fp8_row_tile_rows): the same sums as fp8_gemm.cu's 128 x 128 tiles, element by
// element (each output's K-blocks in the same order, each promoted with the same factor), so the
// same bits, from a sixth fewer operand bytes per FLOP: B (the weights) is read once per 192 rows
// instead of once per 128. The 128-row tiles are bound by those bytes (docs/perf.md, session
// 47: their loads alone take 86% of their time, their math alone 68%).
//
// Grid: persistent, one 512-thread CTA per SM. Before the roles split, the CTA numbers the
// 192-row tiles expert by expert (fp8_rows192_walk.h: a prefix sum over the experts' chunks into
// shared memory; with the routed counts, a chunk of padding alone is in no tile); tile t of the
// walk is (192-row tile, column tile) by walk_unit's groups of kTileGroupM row tiles, as the
// 128-row kernel walks. With params.tile_tickets the CTAs take the walk's tiles by ticket (a
// launch-wide counter) instead of statically (CTA c: tiles c, c + grid, ...): tiles of two and
// three chunks cost unlike, and in the static walk a CTA whose tiles are cheaper runs ahead of
// the CTAs that read the same weight tiles (at dsv3_e128's 3 + 2 experts CTA c always takes the
// tiles of c's parity), which then read them from HBM again. By ticket the tiles in flight are
// a window of consecutive ones. The counter carries the launch's epoch (tile_tickets.h, as the
// bf16 row tiles' does), so nothing is reset. Which CTA computes a tile changes, how it is
// computed does not: the same bits.
// Warp roles:
//   warpgroup 0     scheduler: warp 1's first thread takes the CTA's tiles (static or by
//                   ticket) into a ring of two entries (tiles; full / empty barriers), each read
//                   by the producer and by every consumer warp: it takes tile j + 2 while the
//                   producer loads tile j (the atomic's round trip under a tile's loads), and
//                   holds no more, so the CTA keeps few tiles that others could take.
//                   producer: warp 0's first thread loads each K-block of 128 into a stage with
//                   TMA: A's rows as 64-row chunks (8 KB each; an expert's last tile loads only
//                   the chunks it holds, so a part-filled tile reads what 128-row tiles would),
//                   B's 128 x 128 block (16 KB) and A's 192 line scales.
//                   gatherers (kGather: Fp8GemmParams::row_gather): warps 2-3 gather and
//                   quantize A's rows from the tokens (fp8_row_gather.cuh); the producer waits
//                   for a tile's valid chunks before its first K-block.
//                   The warpgroup gives its registers away (setmaxnreg.dec to 32). With the
//                   tickets taken by the producer itself ptxas spilled at 32, and at 40 / 152
//                   registers the row tiles ran ~5% slower (docs/perf.md, session 51).
//   warpgroups 1-3  consumers: warpgroup 1 + c owns the tile's rows [64 c, 64 c + 64), one fp32
//                   register tile of products and one of the promoted sum (160 registers each:
//                   three consumer warpgroups fit the register file only with one K-block in
//                   flight). Per K-block: four wgmma m64n128k32 e4m3, wait, hand the stage back,
//                   promote (one FFMA an element: scale_a[row] * scale_b). While one warpgroup
//                   promotes, the other two keep the tensor pipe busy (Fp8WgmmaCeilingGpu: 99.8%
//                   of the peak for this loop without loads). A warpgroup whose chunk is past its
//                   expert's rows (an expert's last tile) passes the stages without math.
// Pipeline: 4 stages of 40.75 KB; the epilogue writes bf16 into a 48 KB staging tile (each
// warpgroup its own [64 x 128] as two 128B-swizzled [64 x 64] chunks) and the first consumer
// thread stores the valid chunks with TMA, the store overlapping the next tile's mainloop.
// With Fp8GemmParams::swiglu_h_codes (the gate/up GEMM; MoeConfig::fp8_swiglu) the
// walk's units are pairs of tiles, a column tile of g and the one of u of the same columns, which
// the scheduler writes as two ring entries: g's epilogue stages its bf16 tile as always (stored
// only with swiglu_stores_gate_up) and leaves it there; u's epilogue reads each thread's g pairs
// back from the places it wrote them and quantizes h from them and its own accumulators
// (fp8_swiglu_epilogue.cuh: h's 1 x 128 groups are one quad's row), with the pass's bits.
// B's per-K-block scales: read a tile ahead into the other of two shared-memory rows, as in the
// 128-row kernel. Not here: CTA pairs, the expert groups walk, the lockstep (the layer turns it
// off for these tiles).
#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/common/overlapped_launch.h"
#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/fp8_gemm.h"
#include "kernels/gemm/fp8_row_gather.cuh"
#include "kernels/gemm/fp8_row_tile_sources.cuh"
#include "kernels/gemm/fp8_rows192_walk.h"
#include "kernels/gemm/fp8_swiglu_epilogue.cuh"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/gemm/tile_walk.h"
#include "mok/shape.h"

namespace mok::kernels {

namespace {

constexpr int kConsumerWarpgroups = kRows192Chunks;
constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
constexpr int kConsumers = 128 * kConsumerWarpgroups;
constexpr int kProducerRegs = 32;
// MoeConfig::fp8_gather_in_gate_up: the pairs of groups each gatherer warp (warps 2-3 of the
// producer warpgroup, at kProducerRegs) loads before it quantizes any. Two: ptxas then keeps a
// few hoisted addresses in local memory (seven L1 loads per two pairs), which costs a warp that
// waits on its global loads little; one halves the bytes in flight.
constexpr int kGatherInFlight = 2;
constexpr int kConsumerRegs = 160;
static_assert(128 * (kProducerRegs + kConsumerWarpgroups * kConsumerRegs) <= 65536,
              "the register split fits the 512-thread CTA's pool");
constexpr int kStages = 4;
constexpr int kATileBytes = kRows192 * kFp8BlockK;        // 24 KB
constexpr int kAChunkBytes = kRows192Chunk * kFp8BlockK;  // 8 KB: A's TMA box (64 rows)
constexpr int kBTileBytes = kFp8TileN * kFp8BlockK;       // 16 KB
constexpr int kStagingChunkBytes = kRows192Chunk * 128;   // [64 rows x 64 columns] bf16
// Entries of the scheduler's ring: it takes tile j + 2 while the producer loads tile j, a tile
// ahead of what the consumers read (tile j + 1, during tile j's first K-block), and no further,
// so that a CTA holds few tiles that others could have taken.
constexpr int kTileRing = 2;
constexpr int kTileReaders = 1 + kConsumers;  // the producer thread and every consumer thread
constexpr int kPrefixPerThread = static_cast<int>(kMaxExperts) / kThreads;
static_assert(kPrefixPerThread * kThreads == kMaxExperts, "the prefix sum's experts per thread");
static_assert(kMaxTileKBlocks <= kConsumers, "one B scale per consumer thread (the first ones)");

struct alignas(1024) Rows192Storage {
  uint8_t a[kStages][kATileBytes];
  uint8_t b[kStages][kBTileBytes];
  uint8_t staging[kConsumerWarpgroups][kFp8TileN / 64][kStagingChunkBytes];
  float a_scales[kStages][kRows192];
  float tile_b_scales[2][kMaxTileKBlocks];  // by the CTA's tile parity
  int32_t tile_start[kMaxExperts + 1];      // fp8_rows192_walk.h
  int32_t warp_totals[kThreads / 32];
  // The scheduler's ring: the CTA's j-th tile at j % kTileRing (kNoTile after its last), full
  // when written, empty when the producer and every consumer thread have read it.
  int32_t tiles[kTileRing];
  uint64_t full[kStages];
  uint64_t empty[kStages];
  uint64_t tile_full[kTileRing];
  uint64_t tile_empty[kTileRing];
};
static_assert(sizeof(Rows192Storage) + 1024 <= 227 * 1024, "fits the SM's shared memory");

struct Tile {
  Rows192Tile rows;
  int n_tile;
};

constexpr int kNoTile = -1;

// The CTA's tiles in turn, for its scheduler thread: the static walk's, or by ticket.
struct TileTaker {
  GemmTickets tickets;      // counter null: the static walk
  unsigned long long base;  // this launch's first ticket (by ticket)
  int num_tiles;

  __device__ __forceinline__ TileTaker(const GemmTickets& tickets_, int num_tiles_)
      : tickets(tickets_),
        base(tickets_.counter != nullptr ? ticket_base(tickets_) : 0ull),
        num_tiles(num_tiles_) {}

  // The tile after `last` (the CTA's last taken; -1 before the first), or kNoTile (never
  // called again after it).
  __device__ __forceinline__ int take(int last) const {
    if (tickets.counter == nullptr) {
      const int tile = last < 0 ? static_cast<int>(blockIdx.x) : last + static_cast<int>(gridDim.x);
      return tile < num_tiles ? tile : kNoTile;
    }
    const int32_t unit = take_unit(tickets, base, num_tiles);
    return unit == kStopUnit ? kNoTile : unit;
  }
};

// kSwiglu: tiles 2 u and 2 u + 1 are walk unit u's column tile of g and the one of u (the same
// columns of the other half), taken by one CTA in that order.
template <bool kSwiglu>
__device__ __forceinline__ Tile tile_at(const Fp8GemmParams& params, const int32_t* tile_start,
                                        int tile, int num_m_tiles, int num_n_tiles) {
  const int half_n_tiles = kSwiglu ? num_n_tiles / 2 : num_n_tiles;
  const WalkUnit walk = walk_unit(kSwiglu ? tile / 2 : tile, num_m_tiles, half_n_tiles, true);
  return {rows192_tile(walk.m_unit, tile_start, params.num_experts, params.expert_offsets,
                       params.expert_counts),
          walk.n_tile + (kSwiglu && (tile & 1) ? half_n_tiles : 0)};
}

// tile_start [E + 1] into shared memory: each thread counts kPrefixPerThread experts' tiles,
// then a scan over the warps' totals.
__device__ __forceinline__ void number_the_tiles(const Fp8GemmParams& params,
                                                 Rows192Storage& smem) {
  const int first = threadIdx.x * kPrefixPerThread;
  int32_t tiles[kPrefixPerThread];
  int32_t own = 0;
#pragma unroll
  for (int i = 0; i < kPrefixPerThread; ++i) {
    const int e = first + i;
    tiles[i] = e < params.num_experts
                   ? rows192_tiles(rows192_chunks(e, params.expert_offsets, params.expert_counts))
                   : 0;
    own += tiles[i];
  }
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t inclusive = own;
#pragma unroll
  for (int step = 1; step < 32; step *= 2) {
    const int32_t below = __shfl_up_sync(0xffffffffu, inclusive, step);
    if (lane >= step) inclusive += below;
  }
  if (lane == 31) smem.warp_totals[warp] = inclusive;
  __syncthreads();
  int32_t before = inclusive - own;
  for (int w = 0; w < warp; ++w) before += smem.warp_totals[w];
  if (threadIdx.x == 0) smem.tile_start[0] = 0;
#pragma unroll
  for (int i = 0; i < kPrefixPerThread; ++i) {
    before += tiles[i];
    if (first + i < params.num_experts) smem.tile_start[first + i + 1] = before;
  }
}

template <bool kSwiglu, bool kGather>
__global__ void __launch_bounds__(kThreads, 1)
    fp8_gemm_192_rows_kernel(const __grid_constant__ Fp8GemmMaps maps, const Fp8GemmParams params) {
  ptx::begin_after_previous_kernel();
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Rows192Storage& smem = ptx::align_shared_1024<Rows192Storage>(smem_raw);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      ptx::mbarrier_init(&smem.full[s], 1);
      ptx::mbarrier_init(&smem.empty[s], kConsumers / 32);
    }
    for (int j = 0; j < kTileRing; ++j) {
      ptx::mbarrier_init(&smem.tile_full[j], 1);
      ptx::mbarrier_init(&smem.tile_empty[j], kTileReaders);
    }
    ptx::fence_barrier_init();
  }
  number_the_tiles(params, smem);
  __syncthreads();
  const int num_m_tiles = smem.tile_start[params.num_experts];
  const int num_n_tiles = params.n_extent / kFp8TileN;
  const int num_tiles = num_m_tiles * num_n_tiles;
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegs>();
    // kGather: the launch's epoch of the gather's ticket and counts (fp8_row_gather.cuh).
    const unsigned long long gather_epoch = kGather ? fp8_gather_epoch(params.row_gather) : 0ull;
    if (kGather && threadIdx.x >= 64) {  // warps 2-3: the gatherers
      fp8_gather_rows<kGatherInFlight>(params.row_gather, params.header, params.k_extent);
      return;
    }
    if (threadIdx.x == 32) {  // the scheduler
      // kSwiglu: the taker hands out units of two tiles, each written as its two entries.
      const TileTaker taker{params.tile_tickets, kSwiglu ? num_tiles / 2 : num_tiles};
      for (int j = 0, last = -1;; ++j) {
        const int slot = j % kTileRing;
        mbarrier_wait(params.wait, WaitSite::kTileRingSlot, &smem.tile_empty[slot],
                      ((j / kTileRing) & 1) ^ 1);
        int tile;
        if (kSwiglu && (j & 1)) {
          tile = 2 * last + 1;  // the unit's u tile
        } else {
          const int unit = taker.take(last);
          if (unit != kNoTile) last = unit;
          tile = unit == kNoTile ? kNoTile : (kSwiglu ? 2 * unit : unit);
        }
        smem.tiles[slot] = tile;
        ptx::mbarrier_arrive(&smem.tile_full[slot]);  // releases the entry
        if (tile == kNoTile) break;
      }
      return;
    }
    if (threadIdx.x != 0) return;
    ptx::prefetch_tensor_map(&maps.a);
    ptx::prefetch_tensor_map(&maps.b);
    PipelineState<kStages> state;
    for (int j = 0;; ++j) {
      const int slot = j % kTileRing;
      mbarrier_wait(params.wait, WaitSite::kScheduledTile, &smem.tile_full[slot],
                    (j / kTileRing) & 1);
      const int tile = smem.tiles[slot];
      ptx::mbarrier_arrive(&smem.tile_empty[slot]);
      if (tile == kNoTile) break;
      const Tile t = tile_at<kSwiglu>(params, smem.tile_start, tile, num_m_tiles, num_n_tiles);
      const uint32_t bytes = t.rows.valid_chunks * kAChunkBytes + kBTileBytes + kRows192 * 4;
      const int num_k_blocks = params.k_extent / kFp8BlockK;
      if constexpr (kGather)  // the tile's A chunks gathered (fp8_row_gather.cuh)
        fp8_wait_for_gathered_rows(params.wait, params.row_gather, t.rows.row0, t.rows.valid_chunks,
                                   gather_epoch);
      for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
        const int s = state.stage;
        if (!arm_free_stage(params, &smem.empty[s], &smem.full[s], state.phase, bytes)) {
          state.advance();
          continue;
        }
        const Fp8Sources src = row_tile_sources(maps, params, t.n_tile, k_block);
        for (int c = 0; c < t.rows.valid_chunks; ++c)
          ptx::tma_load_2d(smem.a[s] + c * kAChunkBytes, src.a, &smem.full[s],
                           src.k_group * kFp8BlockK, t.rows.row0 + c * kRows192Chunk);
        ptx::tma_load_3d(smem.b[s], src.b, &smem.full[s], src.k_group * kFp8BlockK,
                         src.b_n_tile * kFp8TileN, t.rows.expert);
        ptx::tma_load_2d(smem.a_scales[s], src.a_scales, &smem.full[s], t.rows.row0, src.k_group);
        state.advance();
      }
    }
    return;
  }

  ptx::setmaxnreg_inc<kConsumerRegs>();
  // Warp-uniform by a shuffle, so that ptxas keeps the descriptors in uniform registers.
  const int chunk = __shfl_sync(0xffffffffu, warpgroup - 1, 0);
  const uint64_t desc_a0 = ptx::smem_desc_k_major_sw128(smem.a[0] + chunk * kRows192Chunk * 128);
  const uint64_t desc_b0 = ptx::smem_desc_k_major_sw128(smem.b[0]);
  constexpr uint64_t kADescStep = kATileBytes >> 4, kBDescStep = kBTileBytes >> 4;
  const int consumer_thread = threadIdx.x - 128;
  const bool issuer = consumer_thread == 0;
  const int row0 = chunk * kRows192Chunk + fragment_row(0), row1 = row0 + 8;
  const int num_k_blocks = params.k_extent / kFp8BlockK;
  PipelineState<kStages> state;
  float block[64];  // one K-block's products (the wgmma accumulators)
  float sum[64];    // the promoted fp32 sum
  auto tile_b_scale = [&](const Tile& t, bool valid) {
    return valid && consumer_thread < num_k_blocks
               ? row_tile_b_scale(params, t.rows.expert, t.n_tile, consumer_thread)
               : 0.0f;
  };
  // Entry j of the scheduler's ring, read and handed back by every consumer thread: each read is
  // then ordered before an arrival that frees the entry in its own thread's program order, which
  // racecheck sees (the other lanes' reads before lane 0's arrival after __syncwarp it reported as
  // hazards). Every lane reads the entry, so the tile's coordinates stay in uniform registers: lane
  // 0 reading it and the others taking it by shuffle moved the walk's arithmetic onto the vector
  // path and made the kernel ~15% slower (session 62).
  auto scheduled_tile = [&](int j) {
    const int slot = j % kTileRing;
    mbarrier_wait(params.wait, WaitSite::kScheduledTile, &smem.tile_full[slot],
                  (j / kTileRing) & 1);
    const int tile = smem.tiles[slot];
    ptx::mbarrier_arrive(&smem.tile_empty[slot]);
    return tile;
  };
  const int first_tile = scheduled_tile(0);
  if (first_tile == kNoTile) return;
  Tile next = tile_at<kSwiglu>(params, smem.tile_start, first_tile, num_m_tiles, num_n_tiles);
  if (consumer_thread < kMaxTileKBlocks)
    smem.tile_b_scales[0][consumer_thread] = tile_b_scale(next, true);
  ptx::named_barrier_sync(1, kConsumers);
  for (int local_tile = 0; next.n_tile != kNoTile; ++local_tile) {
    const Tile t = next;
    const float* tile_b_scales = smem.tile_b_scales[local_tile & 1];
    // A chunk past the expert's rows, or the no-math ablation: the stages passed, no math.
    const bool active = chunk < t.rows.valid_chunks && params.ablation != GemmAblation::kNoMath;
    float next_tile_b_scale = 0.0f;
#pragma unroll
    for (int r = 0; r < 64; ++r) sum[r] = -0.0f;  // -0 + x is x: the first block's bare product
    for (int k_block = 0; k_block < num_k_blocks; ++k_block) {
      const int s = state.stage;
      mbarrier_wait(params.wait, WaitSite::kGemmLoadedStage, &smem.full[s], state.phase);
      float factor0 = 0.0f, factor1 = 0.0f;
      if (active) {
        ptx::fence_registers(block);
        ptx::wgmma_fence();
#pragma unroll
        for (int k = 0; k < kFp8BlockK / 32; ++k)  // 32 bytes = 2 descriptor units per step
          ptx::wgmma_m64n128k32_e4m3(block, desc_a0 + s * kADescStep + 2 * k,
                                     desc_b0 + s * kBDescStep + 2 * k, k > 0);
        ptx::wgmma_commit();
        const float scale_b = tile_b_scales[k_block];
        factor0 = smem.a_scales[s][row0] * scale_b;
        factor1 = smem.a_scales[s][row1] * scale_b;
        ptx::wgmma_wait<0>();
        ptx::fence_registers(block);
      }
      __syncwarp();  // every lane has read its scales before the stage is handed back
      if (threadIdx.x % 32 == 0) ptx::mbarrier_arrive(&smem.empty[s]);
      state.advance();
      if (active) {
        // Fragment register j * 4 + i * 2 + c: row row0 + 8 i, column fragment_col(j) + c.
#pragma unroll
        for (int j = 0; j < kFp8TileN / 8; ++j)
#pragma unroll
          for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
              const int r = j * 4 + i * 2 + c;
              sum[r] = fmaf(block[r], i == 0 ? factor0 : factor1, sum[r]);
            }
      }
      if (k_block == 0) {  // the next tile's coordinates and B scale, off the first K-block's path
        const int next_tile = scheduled_tile(local_tile + 1);
        const bool has_next = next_tile != kNoTile;
        if (has_next)
          next = tile_at<kSwiglu>(params, smem.tile_start, next_tile, num_m_tiles, num_n_tiles);
        else
          next.n_tile = kNoTile;  // ends the loop after this tile
        next_tile_b_scale = tile_b_scale(next, has_next);
      }
    }
    // The next tile's B scales, published by the staging barrier below (the other row is no
    // longer read: every consumer passed this tile's first barrier after the last tile's math).
    if (consumer_thread < kMaxTileKBlocks)
      smem.tile_b_scales[(local_tile + 1) & 1][consumer_thread] = next_tile_b_scale;
    // kSwiglu: a unit's g tile stays staged for its u tile, whose epilogue reads it back (each
    // thread the places it wrote) and quantizes h; g and u are stored unless the forward keeps
    // no context.
    const bool u_tile = kSwiglu && t.n_tile >= num_n_tiles / 2;
    const bool stores = !kSwiglu || params.swiglu_stores_gate_up != 0;
    const bool rows_valid = chunk < t.rows.valid_chunks;
    if (issuer) ptx::bulk_wait_group_read<0>();  // the last tile's store has read the staging
    ptx::named_barrier_sync(1, kConsumers);
    // kSwiglu: the unit's g and this tile's u as bf16 pairs, pair j of fragment row i at
    // block[16 i + j] and block[32 + 16 i + j]. The wgmma accumulators are live from tile to tile
    // (fence_registers' operands), so the SwiGLU below takes no registers beyond the default
    // epilogue's; in registers of their own they spilled 200 bytes.
    if (rows_valid) {
      // Two [64 x 64] chunks of this warpgroup's rows, 128B-swizzled as TMA stores them.
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = fragment_row(i);
#pragma unroll
        for (int j = 0; j < kFp8TileN / 8; ++j) {
          char* chunk_base = reinterpret_cast<char*>(smem.staging[chunk][j / 8]);
          const int offset = staged_pair_offset(0, row, j);
          const __nv_bfloat162 pair =
              __floats2bfloat162_rn(sum[j * 4 + i * 2], sum[j * 4 + i * 2 + 1]);
          if constexpr (kSwiglu) {
            block[32 + 16 * i + j] = __uint_as_float(bf16x2_bits(pair));
            block[16 * i + j] = *reinterpret_cast<const float*>(chunk_base + offset);
          }
          if (!u_tile || stores) *reinterpret_cast<__nv_bfloat162*>(chunk_base + offset) = pair;
        }
      }
    }
    ptx::fence_proxy_async_shared();
    ptx::named_barrier_sync(1, kConsumers);
    if (issuer && stores) {
      const int column = t.n_tile * kFp8TileN;
      const bool second = params.n_split > 0 && column >= params.n_split;
      const CUtensorMap* out = second ? &maps.out2 : &maps.out;
      const int out_column = second ? column - params.n_split : column;
      for (int c = 0; c < t.rows.valid_chunks; ++c)
        for (int half = 0; half < kFp8TileN / 64; ++half)
          ptx::tma_store_3d(out, smem.staging[c][half], out_column + 64 * half,
                            t.rows.row0 + c * kRows192Chunk, 0);
      ptx::bulk_commit_group();
    }
    if (u_tile && rows_valid)  // h's group (t.n_tile - num_n_tiles / 2) of each row
      swiglu_quantize_fragment_rows(
          params, static_cast<int64_t>(t.rows.row0) + chunk * kRows192Chunk,
          t.n_tile - num_n_tiles / 2,
          [&](int i, int j) { return __float_as_uint(block[16 * i + j]); },
          [&](int i, int j) { return __float_as_uint(block[32 + 16 * i + j]); });
  }
  if (issuer) ptx::bulk_wait_group<0>();  // the last store reads the staging tile
}

}  // namespace

cudaError_t launch_fp8_gemm_192_rows(const Fp8GemmMaps& maps, const Fp8GemmParams& params,
                                     int num_ctas, KernelStream on) {
  if (params.num_experts <= 0 || params.num_experts > kMaxExperts ||
      params.expert_offsets == nullptr || params.expert_groups != 0)
    return cudaErrorInvalidValue;
  // swiglu_h_codes' extents and row_gather's buffers: checked by launch_fp8_grouped_gemm, the
  // caller.
  const bool swiglu = params.swiglu_h_codes != nullptr;
  const auto kernel =
      params.row_gather.tokens != nullptr
          ? (swiglu ? fp8_gemm_192_rows_kernel<true, true> : fp8_gemm_192_rows_kernel<false, true>)
          : (swiglu ? fp8_gemm_192_rows_kernel<true, false>
                    : fp8_gemm_192_rows_kernel<false, false>);
  const size_t smem_bytes = sizeof(Rows192Storage) + 1024;
  cudaError_t status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(smem_bytes));
  if (status != cudaSuccess) return status;
  return launch_maybe_overlapped(kernel, num_ctas, kThreads, smem_bytes, on, 1, maps, params);
}

}  // namespace mok::kernels
