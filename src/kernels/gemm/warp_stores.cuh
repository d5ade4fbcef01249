// The expert GEMM's epilogue in which each consumer warp stores its own rows
// (ExpertGemmParams::warp_stores; expert_gemm.cu's kWarpStores), for the row-tile forms without
// CTA pairs or the expert-parallel push.
//
// Why: the row-tile GEMMs wait on their loads (docs/perf.md, session 20: with the loads left
// out the gate/up GEMM at dsv3_e128 runs in 2.58 ms instead of 3.70), and three stages of 48 KB
// keep only one stage loading while the consumers hold two. The staging tile of epilogue.cuh
// (64 KB) is what the fourth stage would need. Here the tile leaves through 4 KB per warp: the
// ring gets four stages (192 KB + 32 KB).
//
// Warp w of the consumers (consumer w / 4) holds rows 16 (w % 4) + [0, 16) of its warpgroup's 64
// (the wgmma fragment, gemm_mainloop.cuh) for all 256 columns. Per 64-column chunk it writes its
// fragments as bf16 into a [16 rows x 64 columns] buffer (128-byte rows, the 16-byte unit u of
// row r at u ^ (r % 8): the writes of a fragment and the reads of a row are both free of bank
// conflicts), then each lane reads four 16-byte units back and stores them: eight lanes write
// each row's 128 contiguous bytes. Nothing waits on another warp: the only barriers are the
// warp's own __syncwarp.
// What each form stores is what epilogue.cuh's store_tile stores, to the same rows (the outputs as
// pointers and row counts, RowOutputs): kGateUpSwiGLU bf16(g) to out[1], bf16(u) to out[2] and h
// = swiglu(g, u) from those bf16 values (swiglu_forward_unit, the same bits) to out[0];
// kGateUpStore g to out[0] and u to out[1]; the 256-column forms to out[0]. 64-row tiles (the
// forward's, where the experts have few rows) at warp_store_tile.
#pragma once

#include <cuda_bf16.h>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/stages/swiglu.cuh"

namespace mok::kernels {

constexpr int kWarpStoreStages = 4;
constexpr int kWarpStoreRows = 16;                     // a consumer warp's rows of the tile
constexpr int kWarpChunkBytes = kWarpStoreRows * 128;  // [16 rows x 64 columns] bf16
constexpr int kWarpStoreBytes = 2 * kWarpChunkBytes;   // per warp: g and u of a gate/up chunk
constexpr int kConsumerWarps = kConsumerThreads / 32;
// The ring of four stages and the warps' buffers as the storage's staging rows.
using WarpStoreStorage = GemmSharedStorage<kWarpStoreStages, BLOCK_M, BLOCK_N,
                                           kConsumerWarps * kWarpStoreBytes / (BLOCK_N * 2)>;
static_assert(sizeof(WarpStoreStorage) + 1024 <= 227 * 1024, "four stages fit");

// Writes value(i, j) for column groups j in [first, first + 8) of this warp's fragment rows into
// `buffer` as bf16 pairs.
template <typename Value>
__device__ __forceinline__ void stage_warp_chunk(char* buffer, int first, Value value) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = lane / 4 + 8 * i;
#pragma unroll
    for (int g = 0; g < 8; ++g) {
      const float2 pair = value(i, first + g);
      *reinterpret_cast<__nv_bfloat162*>(buffer + r * 128 + ((g ^ (r % 8)) << 4) + (lane % 4) * 4) =
          __floats2bfloat162_rn(pair.x, pair.y);
    }
  }
}

// The 16-byte unit q of this lane's four (q in [0, 4)): row r and unit u of the chunk, and its
// place in a buffer.
struct WarpUnit {
  int row;
  int unit;
  int offset;
};
__device__ __forceinline__ WarpUnit warp_unit(int q) {
  const int index = threadIdx.x % 32 + 32 * q;
  const int row = index / 8, unit = index % 8;
  return {row, unit, row * 128 + ((unit ^ (row % 8)) << 4)};
}

// Where output row `row` (of `rows`), columns [col, col + 8), lies; null past the rows.
__device__ __forceinline__ uint4* output_unit(__nv_bfloat16* out, int64_t ld, int rows, int row,
                                              int col) {
  return row < rows ? reinterpret_cast<uint4*>(out + static_cast<int64_t>(row) * ld + col)
                    : nullptr;
}

// One 64-column chunk of a single output: staged, then stored to rows [row0, row0 + 16),
// columns [col, col + 64), of `out` (chunks at or past n_extent are left out, as TMA clips them).
template <typename Value>
__device__ __forceinline__ void store_warp_chunk(char* buffer, __nv_bfloat16* out, int rows,
                                                 int64_t ld, int row0, int col, int n_extent,
                                                 int first, Value value) {
  __syncwarp();  // the warp's reads of the previous chunk are done
  stage_warp_chunk(buffer, first, value);
  __syncwarp();
  if (col >= n_extent) return;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const WarpUnit u = warp_unit(q);
    uint4* dst = output_unit(out, ld, rows, row0 + u.row, col + 8 * u.unit);
    if (dst != nullptr) *dst = *reinterpret_cast<const uint4*>(buffer + u.offset);
  }
}

// Zeros to rows [row0, row0 + 16) and columns [col, col + 128) of `out` (columns at or past
// n_extent left out): a 64-row tile's padding rows 64-127, which a 128-row tile computes as
// zeros from the padding's zero A rows.
__device__ __forceinline__ void store_warp_zeros(__nv_bfloat16* out, int rows, int64_t ld, int row0,
                                                 int col, int n_extent) {
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const int index = threadIdx.x % 32 + 32 * q;  // 16 rows x 16 units
    const int unit_col = col + 8 * (index % 16);
    if (unit_col >= n_extent) continue;
    if (uint4* dst = output_unit(out, ld, rows, row0 + index / 16, unit_col))
      *dst = make_uint4(0, 0, 0, 0);
  }
}

// A gate/up chunk's 16-byte units [first_q, first_q + num_q) of this lane's four: bf16(g) and
// bf16(u) from the two buffers to their outputs, and with kSwiGLU h = swiglu(g, u) to out[0].
template <bool kSwiGLU>
__device__ __forceinline__ void store_gate_up_units(const ExpertGemmParams& params,
                                                    const char* gate_buffer, const char* up_buffer,
                                                    int row0, int col, int first_q, int num_q) {
  constexpr int kGate = kSwiGLU ? 1 : 0, kUp = kSwiGLU ? 2 : 1;
  const RowOutputs& outs = params.row_outputs;
  const int64_t ld = params.n_extent;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (q < first_q || q >= first_q + num_q) continue;
    const WarpUnit u = warp_unit(q);
    const int row = row0 + u.row, unit_col = col + 8 * u.unit;
    const uint4 gate = *reinterpret_cast<const uint4*>(gate_buffer + u.offset);
    const uint4 up = *reinterpret_cast<const uint4*>(up_buffer + u.offset);
    if (uint4* dst = output_unit(outs.out[kGate], ld, outs.rows[kGate], row, unit_col)) *dst = gate;
    if (uint4* dst = output_unit(outs.out[kUp], ld, outs.rows[kUp], row, unit_col)) *dst = up;
    if constexpr (kSwiGLU) {
      // The branch-free division first; `a / b` where an operand is out of its range
      // (swiglu.cuh: the same bits).
      uint4 h;
      if (!swiglu_forward_unit<true>(gate, up, params.swiglu_limit, h))
        swiglu_forward_unit<false>(gate, up, params.swiglu_limit, h);
      if (uint4* dst = output_unit(outs.out[0], ld, outs.rows[0], row, unit_col)) *dst = h;
    }
  }
}

// The named barrier of consumer warps q and q + 4, which hold the same rows of a 64-row tile
// (ids 2-5: 0 is __syncthreads, 1 the staging tile's).
__device__ __forceinline__ void sync_warp_pair(int warp) {
  ptx::named_barrier_sync(2 + warp % 4, 64);
}

// The consumers' epilogue of one tile (see the top of the file). `buffers`: the warps'
// kWarpStoreBytes each, this warp's at warp * kWarpStoreBytes.
// A 64-row tile (coord.half; consume_tile's kHalf): consumer c holds rows 0-63 of the tile's
// columns [128c, 128c + 128), so warp q of each consumer has rows 16q + [0, 16), and both
// consumers store rows 64-127 as zeros. In the gate/up forms consumer 0 holds the gate columns
// and consumer 1 the up columns: each pair of warps (q, q + 4) stages its halves, syncs, stores
// g, u (and h) from both buffers, half the units each, and syncs again before either buffer is
// written (the next chunk's, or the next tile's own).
template <ExpertGemmForm kForm>
__device__ __forceinline__ void warp_store_tile(char* buffers, const ExpertGemmParams& params,
                                                const TileCoord& coord, int consumer_idx,
                                                const float (&acc)[128]) {
  const int warp = (threadIdx.x - BLOCK_M) / 32;
  const int tile_row = coord.m_tile * BLOCK_M - params.macrobatch.out_row_base;
  const int row0 = tile_row + (coord.half ? 0 : consumer_idx * 64) + (warp % 4) * kWarpStoreRows;
  const RowOutputs& outs = params.row_outputs;
  const int64_t ld = params.n_extent;
  char* own = buffers + warp * kWarpStoreBytes;
  auto fragment = [&](int i, int j) {
    return make_float2(acc[j * 4 + i * 2], acc[j * 4 + i * 2 + 1]);
  };
  if constexpr (kForm == ExpertGemmForm::kGateUpSwiGLU || kForm == ExpertGemmForm::kGateUpStore) {
    constexpr bool kSwiGLU = kForm == ExpertGemmForm::kGateUpSwiGLU;
    if (!coord.half) {
      char* gate_buffer = own;
      char* up_buffer = own + kWarpChunkBytes;
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        // Gate columns [64k, 64k + 64) of the tile's 128 and the up columns 128 further.
        const int col = coord.n_tile * 128 + 64 * k;
        __syncwarp();
        stage_warp_chunk(gate_buffer, 8 * k, fragment);
        stage_warp_chunk(up_buffer, 16 + 8 * k, fragment);
        __syncwarp();
        if (col < params.n_extent)
          store_gate_up_units<kSwiGLU>(params, gate_buffer, up_buffer, row0, col, 0, 4);
      }
      return;
    }
    // Consumer 0's gate chunk in its warp's first buffer, consumer 1's up chunk in its own.
    char* gate_buffer = buffers + (warp % 4) * kWarpStoreBytes;
    char* up_buffer = buffers + (warp % 4 + 4) * kWarpStoreBytes;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int col = coord.n_tile * 128 + 64 * k;
      sync_warp_pair(warp);  // the pair's reads of the previous chunk (or tile) are done
      stage_warp_chunk(consumer_idx == 0 ? gate_buffer : up_buffer, 8 * k, fragment);
      sync_warp_pair(warp);
      if (col < params.n_extent)
        store_gate_up_units<kSwiGLU>(params, gate_buffer, up_buffer, row0, col, 2 * consumer_idx,
                                     2);
    }
    sync_warp_pair(warp);  // each warp's buffer is its own again for the next tile
    constexpr int kGate = kSwiGLU ? 1 : 0, kUp = kSwiGLU ? 2 : 1;
    const int zero_row = tile_row + 64 + (warp % 4) * kWarpStoreRows;
    const int col = coord.n_tile * 128;
    if (consumer_idx == 0) {
      store_warp_zeros(outs.out[kGate], outs.rows[kGate], ld, zero_row, col, params.n_extent);
      if constexpr (kSwiGLU)
        store_warp_zeros(outs.out[0], outs.rows[0], ld, zero_row, col, params.n_extent);
    } else {
      store_warp_zeros(outs.out[kUp], outs.rows[kUp], ld, zero_row, col, params.n_extent);
    }
  } else {
    if (!coord.half) {
#pragma unroll
      for (int k = 0; k < 4; ++k)
        store_warp_chunk(own, outs.out[0], outs.rows[0], ld, row0, coord.n_tile * BLOCK_N + 64 * k,
                         params.n_extent, 8 * k, fragment);
      return;
    }
    const int col = coord.n_tile * BLOCK_N + 128 * consumer_idx;
#pragma unroll
    for (int k = 0; k < 2; ++k)
      store_warp_chunk(own, outs.out[0], outs.rows[0], ld, row0, col + 64 * k, params.n_extent,
                       8 * k, fragment);
    store_warp_zeros(outs.out[0], outs.rows[0], ld, tile_row + 64 + (warp % 4) * kWarpStoreRows,
                     col, params.n_extent);
  }
}

}  // namespace mok::kernels
