// Epilogues of the expert grouped GEMMs: the fp32 accumulators in the consumer warpgroups'
// registers (fragment layout in gemm_mainloop.cuh) become bf16 outputs, with one rounding point
// per output as docs/design.md lists them.
//
// Every form leaves through the same path: the consumer threads write bf16 values into a
// 128 x 256 shared-memory staging tile, then one thread stores it with TMA, and the store runs
// in the background while the consumers start the next tile's mainloop. Before the tile is
// written again, that thread waits until the previous store has read it. The staging tile is
// four chunks of [128 rows x 64 columns] with 128-byte rows swizzled as TMA expects (16-byte unit
// u of row r sits at u ^ (r % 8), which also makes each warp's writes bank-conflict free); the
// fragment of column group j (8 columns) lands in chunk j / 8.
//
// What each form stores (column group j < 16: gate columns, j >= 16: the up columns 128 further,
// for the 128 + 128 gate/up tiles):
//   kGateUpSwiGLU     bf16(g) to out2 (chunks 0-1) and bf16(u) to out3 (chunks 2-3), the
//                     forward context (not with params.skip_context_stores); then
//                     h = bf16(swiglu(g, u)) over chunks 0-1, to out
//   kGateUpStore      bf16(g) to out (chunks 0-1), bf16(u) to out2 (chunks 2-3)
//   kDownStore, kDownGrad, kGateUpGradStore  the 256 columns to out [rows, N]; kDownStore and
//                     kGateUpGradStore with params.push also the rows of other ranks' pairs
//                     into their slots (push_tile_rows: the expert-parallel combine's push of
//                     y or dx rows, from the tile)
//   kWeightGrad       the 256 columns to out[e] [M, N]; an expert without rows stores zeros
// Row forms store at (column, tile row, 0) of [rows, N] maps, which clip rows past their extent
// (the shared expert's outputs have exactly T rows).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/stages/swiglu.cuh"

namespace mok::kernels {

struct TileCoord {
  int expert;
  int m_tile;  // 128-row tile (of the schedule's rows, or of M for kWeightGrad)
  int n_tile;
  int k_row0;  // first K row (kWeightGrad: the expert's first row, in the ring's rows)
  int num_k_blocks;
  // kWeightGrad with macrobatches (macrobatch.h): no rows here (skip), resume from an fp32
  // partial slot (load_slot), leave one (store_slot) instead of the bf16 output; -1 = none.
  bool skip = false;
  int load_slot = -1;
  int store_slot = -1;
  // Row-tile forms: the expert's last tile holds at most 64 routed rows and runs as a 64-row
  // tile (consume_tile's kHalf; expert_gemm.cu).
  bool half = false;
};

struct OutputMaps {
  const CUtensorMap* out;
  const CUtensorMap* out2;
  const CUtensorMap* out3;
};

constexpr int kStageChunkBytes = BLOCK_M * 128;  // one [128 rows x 64 columns] bf16 chunk

// Where this thread's column pair j (columns 8 j + 2 q, + 1) of tile row `row` lies in a staging
// tile whose 64-column chunk of it starts at `chunk_offset`, 128B-swizzled as TMA stores it
// (stage_fragments_at's offsets, which keep their own expression: the bf16 GEMMs' SASS).
__device__ __forceinline__ int staged_pair_offset(int chunk_offset, int row, int j) {
  return chunk_offset + row * 128 + (((j % 8) ^ (row % 8)) << 4) + (threadIdx.x % 4) * 4;
}

// Writes value(i, j) (two floats, rounded to a bf16 pair) for fragment row i and column groups
// j in [kFirst, kLast) of this consumer warpgroup into the staging tile, at tile row row_base +
// the fragment's row, column group j landing in chunk j / 8 of `tile`.
// stage_fragments_at puts group kFirst in chunk first_chunk instead (the next ones after it).
template <int kFirst, int kLast, typename Value>
__device__ __forceinline__ void stage_fragments_at(char* tile, int first_chunk, int row_base,
                                                   Value value) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row_base + fragment_row(i);
#pragma unroll
    for (int j = kFirst; j < kLast; ++j) {
      const int offset = (first_chunk + (j - kFirst) / 8) * kStageChunkBytes + row * 128 +
                         (((j % 8) ^ (row % 8)) << 4) + (threadIdx.x % 4) * 4;
      const float2 pair = value(i, j);
      *reinterpret_cast<__nv_bfloat162*>(tile + offset) = __floats2bfloat162_rn(pair.x, pair.y);
    }
  }
}
template <int kFirst, int kLast, typename Value>
__device__ __forceinline__ void stage_fragments(char* tile, int row_base, Value value) {
  static_assert(kFirst % 8 == 0, "column groups start a chunk");
  stage_fragments_at<kFirst, kLast>(tile, kFirst / 8, row_base, value);
}

// Rows 64-127 of the first kChunks chunks as zeros (a 64-row tile's padding rows).
template <int kChunks>
__device__ __forceinline__ void zero_padding_rows(char* tile) {
  const int thread = threadIdx.x - BLOCK_M;
#pragma unroll
  for (int q = 0; q < kChunks * 64 * 8 / kConsumerThreads; ++q) {
    const int unit = thread + kConsumerThreads * q;
    const int chunk = unit / (64 * 8), row = 64 + (unit / 8) % 64;
    *reinterpret_cast<uint4*>(tile + chunk * kStageChunkBytes + row * 128 +
                              (((unit % 8) ^ (row % 8)) << 4)) = make_uint4(0, 0, 0, 0);
  }
}

// A consumer warpgroup's accumulators into the staging tile. A 128-row tile: consumer c's 64 rows
// [64c, 64c + 64) of all 256 columns. A 64-row tile (coord.half): consumer c holds rows 0-63 of
// columns [128c, 128c + 128) in its first 64 registers, so its 16 column groups land in chunks
// 2c and 2c + 1 (one code path for both: the half skips groups 16-31). Rows 64-127 of a 64-row
// tile hold only padding rows (a segment ends at a multiple of 128) and are staged as zeros,
// which is what a 128-row tile computes there from the padding's zero A rows (with finite
// weights); nothing reads a padding row's outputs but the weight gradients, which see zeros
// either way.
template <typename Value>
__device__ __forceinline__ void stage_accumulators(char* tile, int consumer_idx, bool half,
                                                   Value value) {
  char* base = half ? tile + consumer_idx * 2 * kStageChunkBytes : tile;
  const int row_base = half ? 0 : consumer_idx * 64;
  stage_fragments<0, 16>(base, row_base, value);
  if (!half) {
    stage_fragments<16, 32>(base, row_base, value);
    return;
  }
  zero_padding_rows<4>(tile);
}

// The issuing thread (the first consumer thread) waits until the previous store has read the
// staging tile; then every consumer thread may write it.
__device__ __forceinline__ void acquire_staging_tile(bool issuer) {
  if (issuer) ptx::bulk_wait_group_read<0>();
  ptx::named_barrier_sync(1, kConsumerThreads);
}

// Makes the consumers' writes visible to TMA and lets the issuer go on.
__device__ __forceinline__ void publish_staging_tile() {
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(1, kConsumerThreads);
}

// Issuer: stores chunks [first_chunk, first_chunk + num_chunks) to `map` at columns
// col_base + 64 * c (skipping chunks past n_extent), tile row `row`, batch `batch`.
__device__ __forceinline__ void store_chunks(const CUtensorMap* map, const char* tile,
                                             int first_chunk, int num_chunks, int col_base,
                                             int n_extent, int row, int batch) {
  for (int c = 0; c < num_chunks; ++c)
    if (col_base + c * 64 < n_extent)
      ptx::tma_store_3d(map, tile + (first_chunk + c) * kStageChunkBytes, col_base + c * 64, row,
                        batch);
}

// kGateUpSwiGLU after g and u are staged (bf16): each thread computes h = swiglu(g, u) of its
// 16-byte units of g (chunks 0-1) and u (chunks 2-3) while their store reads the tile, writes h
// over g once the store has read it, and the issuer stores h to `out`. h depends only on bf16(g)
// and bf16(u), so the bits are those of computing it from the accumulators; doing it from shared
// memory, 16 bytes at a time, keeps SwiGLU's registers off the accumulators' (the eight units'
// h take 32 registers: no spills). Thread t handles the units t + 256 q of
// chunks 0-1 (eight columns each). kGateChunks 1: one 64-column chunk of g and of u (chunks 0
// and 1), as a round of the four-stage ring's epilogue stages them.
template <int kGateChunks = 2>
__device__ __forceinline__ void stage_swiglu(const CUtensorMap* out, char* tile,
                                             const ExpertGemmParams& params, int col_base, int row,
                                             bool issuer) {
  constexpr int kUnitsPerThread = kGateChunks * BLOCK_M * 8 / kConsumerThreads;
  const int thread = threadIdx.x - BLOCK_M;
  auto gate_unit_at = [&](int q) {
    const int unit = thread + kConsumerThreads * q;
    const int chunk = unit / (BLOCK_M * 8), tile_row = (unit / 8) % BLOCK_M;
    return reinterpret_cast<uint4*>(tile + chunk * kStageChunkBytes + tile_row * 128 +
                                    (((unit % 8) ^ (tile_row % 8)) << 4));
  };
  // h from the staged g and u while the store of g and u reads them (reads beside reads); it is
  // written over g only once that store has read the tile.
  uint4 h[kUnitsPerThread];
#pragma unroll
  for (int q = 0; q < kUnitsPerThread; ++q) {
    const uint4* gate_unit = gate_unit_at(q);
    const uint4 gate = *gate_unit;
    const uint4 up = *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(gate_unit) +
                                                     kGateChunks * kStageChunkBytes);
    if (params.ablation == GemmAblation::kNoSwiglu) {  // a measurement: h = g, no SwiGLU
      h[q] = gate;
      continue;
    }
    h[q] = swiglu_forward_unit(gate, up, params.swiglu_limit);
  }
  acquire_staging_tile(issuer);
#pragma unroll
  for (int q = 0; q < kUnitsPerThread; ++q) *gate_unit_at(q) = h[q];
  publish_staging_tile();
  if (issuer) {
    store_chunks(out, tile, 0, kGateChunks, col_base, params.n_extent, row, 0);
    ptx::bulk_commit_group();
  }
}

// Expert parallel (params.push): the consumer warps copy the staged tile's rows of other ranks'
// pairs into those ranks' slots, a row per warp, lane u taking 16-byte unit u of the row's 256
// columns (chunk u / 8, swizzled as stage_fragments wrote it). The staging tile is rewritten
// only after every consumer passes the next tile's acquire_staging_tile, so the copy is done
// by then; the rows reach the peers before this launch ends, and the push's signal (a launch
// after the forward's GEMMs) tells them.
__device__ __forceinline__ void push_tile_rows(const RowPush& push, const char* tile,
                                               int schedule_row0, int col_base, int n_extent) {
  const int warp = (threadIdx.x - BLOCK_M) / 32, lane = threadIdx.x % 32;
  const int col = col_base + lane * 8;
  for (int r = warp; r < BLOCK_M; r += kConsumerThreads / 32) {
    const int pair = push.row_pair[schedule_row0 + r];
    if (pair < 0) continue;  // padding
    const int source = pair / push.pairs_per_rank, slot = pair % push.pairs_per_rank;
    if (source == push.rank || col >= n_extent) continue;
    const uint4 value = ptx::ld_shared_v4(tile + (lane / 8) * kStageChunkBytes + r * 128 +
                                          (((lane % 8) ^ (r % 8)) << 4));
    *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(push.slot_peers[source]) +
                              static_cast<int64_t>(slot) * n_extent + col) = value;
  }
}

// Round kRound of a tile's epilogue through a staging tile of two chunks (the four-stage ring,
// MoeConfig::gemm_four_stages): 128 of the tile's 256 columns staged, stored and, for
// kGateUpSwiGLU, turned into h before the next round overwrites them.
//   kGateUpSwiGLU  round r: gate chunk r and up chunk r (staging chunks 0 and 1) to out2 / out3
//                  at columns col_base + 64 r, then h's chunk r over the gate chunk, to out
//   kGateUpStore   round r: gate chunk r and up chunk r to out / out2
//   kDownStore, kDownGrad, kGateUpGradStore  round r: the tile's chunks 2r and 2r + 1 to out at
//                  n_tile * 256 + 128 r
// A 64-row tile's consumer c holds columns [128c, 128c + 128) (stage_accumulators): in the gate/up
// it stages its chunk r into staging chunk c; in the down only consumer r stages, both its chunks.
// Not with the expert-parallel push, which reads all 256 columns of a staged row.
template <ExpertGemmForm kForm, int kRound, typename Fragment>
__device__ __forceinline__ void store_round(const OutputMaps& maps, char* tile,
                                            const ExpertGemmParams& params, const TileCoord& coord,
                                            int consumer_idx, int row, bool issuer,
                                            Fragment fragment) {
  static_assert(kForm != ExpertGemmForm::kWeightGrad, "the two-round epilogue serves row tiles");
  constexpr bool kGateUp =
      kForm == ExpertGemmForm::kGateUpSwiGLU || kForm == ExpertGemmForm::kGateUpStore;
  constexpr bool kSwiGLU = kForm == ExpertGemmForm::kGateUpSwiGLU;
  acquire_staging_tile(issuer);
  const int row_base = coord.half ? 0 : consumer_idx * 64;
  if constexpr (kGateUp) {
    if (coord.half) {
      stage_fragments_at<8 * kRound, 8 * kRound + 8>(tile, consumer_idx, row_base, fragment);
    } else {
      stage_fragments_at<8 * kRound, 8 * kRound + 8>(tile, 0, row_base, fragment);
      stage_fragments_at<16 + 8 * kRound, 24 + 8 * kRound>(tile, 1, row_base, fragment);
    }
    if (coord.half) zero_padding_rows<2>(tile);
    publish_staging_tile();
    const int col_base = coord.n_tile * 128 + 64 * kRound;
    if (issuer && !(kSwiGLU && params.skip_context_stores)) {
      store_chunks(kSwiGLU ? maps.out2 : maps.out, tile, 0, 1, col_base, params.n_extent, row, 0);
      store_chunks(kSwiGLU ? maps.out3 : maps.out2, tile, 1, 1, col_base, params.n_extent, row, 0);
      ptx::bulk_commit_group();
    }
    if constexpr (kSwiGLU) stage_swiglu<1>(maps.out, tile, params, col_base, row, issuer);
  } else {
    if (!coord.half)
      stage_fragments_at<16 * kRound, 16 * kRound + 16>(tile, 0, row_base, fragment);
    else if (consumer_idx == kRound)
      stage_fragments_at<0, 16>(tile, 0, row_base, fragment);
    if (coord.half) zero_padding_rows<2>(tile);
    publish_staging_tile();
    if (issuer) {
      store_chunks(maps.out, tile, 0, 2, coord.n_tile * BLOCK_N + 128 * kRound, params.n_extent,
                   row, 0);
      ptx::bulk_commit_group();
    }
  }
}

template <ExpertGemmForm kForm, typename Storage>
__device__ __forceinline__ void store_tile(const OutputMaps& maps, Storage& smem,
                                           const ExpertGemmParams& params, const TileCoord& coord,
                                           int consumer_idx, const float (&acc)[128]) {
  const bool issuer = threadIdx.x == BLOCK_M;  // first consumer thread
  char* tile = reinterpret_cast<char*>(smem.store_tile);
  // Row forms: outputs in a macrobatch's ring sit at row - out_row_base (full-size ones: base 0).
  const int row = coord.m_tile * BLOCK_M -
                  (kForm == ExpertGemmForm::kWeightGrad ? 0 : params.macrobatch.out_row_base);
  auto fragment = [&](int i, int j) {
    return make_float2(acc[j * 4 + i * 2], acc[j * 4 + i * 2 + 1]);
  };
  if constexpr (Storage::kStagingChunks == 2) {
    store_round<kForm, 0>(maps, tile, params, coord, consumer_idx, row, issuer, fragment);
    store_round<kForm, 1>(maps, tile, params, coord, consumer_idx, row, issuer, fragment);
    return;
  }

  acquire_staging_tile(issuer);
  if constexpr (kForm == ExpertGemmForm::kGateUpSwiGLU || kForm == ExpertGemmForm::kGateUpStore) {
    // bf16(g) to chunks 0-1, bf16(u) to chunks 2-3, stored to out / out2 (kGateUpStore) or
    // out2 / out3 (kGateUpSwiGLU, the forward context).
    const int col_base = coord.n_tile * 128;
    stage_accumulators(tile, consumer_idx, coord.half, fragment);
    publish_staging_tile();
    constexpr bool kSwiGLU = kForm == ExpertGemmForm::kGateUpSwiGLU;
    if (issuer && !(kSwiGLU && params.skip_context_stores)) {  // g and u: the forward context
      store_chunks(kSwiGLU ? maps.out2 : maps.out, tile, 0, 2, col_base, params.n_extent, row, 0);
      store_chunks(kSwiGLU ? maps.out3 : maps.out2, tile, 2, 2, col_base, params.n_extent, row, 0);
      ptx::bulk_commit_group();
    }
    if constexpr (kSwiGLU) stage_swiglu(maps.out, tile, params, col_base, row, issuer);
  } else {
    const bool empty = coord.num_k_blocks == 0;  // kWeightGrad: an expert without rows
    stage_accumulators(tile, consumer_idx, coord.half, [&](int i, int j) {
      return empty ? make_float2(0.0f, 0.0f) : fragment(i, j);
    });
    publish_staging_tile();
    if (issuer) {
      store_chunks(maps.out, tile, 0, 4, coord.n_tile * BLOCK_N, params.n_extent, row,
                   kForm == ExpertGemmForm::kWeightGrad ? coord.expert : 0);
      ptx::bulk_commit_group();
    }
    if constexpr (kForm == ExpertGemmForm::kDownStore || kForm == ExpertGemmForm::kGateUpGradStore)
      if (params.push.slot_peers != nullptr)
        push_tile_rows(params.push, tile, coord.m_tile * BLOCK_M, coord.n_tile * BLOCK_N,
                       params.n_extent);
  }
}

}  // namespace mok::kernels
