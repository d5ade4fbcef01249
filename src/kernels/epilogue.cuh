// Epilogues of the expert grouped GEMMs: the fp32 accumulators in the consumer warpgroups'
// registers (fragment layout in gemm_mainloop.cuh) become bf16 outputs. One rounding point per
// output, as docs/design.md lists them.
//
// Register epilogues (4-byte stores straight from the fragments):
//   kGateUpSwiGLU      register j (gate column) pairs with j + 16 (the up column 128 further):
//                      h = swiglu(g, u) is thread-local; with out2/out3 set it also keeps
//                      bf16(g) and bf16(u) (the forward context).
//   kGateUpStore       the same pairing, storing bf16(g) and bf16(u) for the backward.
//   kDownGrad          dh_raw = bf16(acc) rows, stored as they are.
// Staging-tile epilogues (store_tile below: a 128x256 shared-memory tile and a TMA store that
// runs in the background while the consumers start the next tile's mainloop):
//   kDownStore, kGateUpGradStore  rows in schedule order into out [rows, N] (the map clips rows
//                                 past its extent, e.g. the shared expert's last tile)
//   kWeightGrad                   out[e] [M, N]; an expert without rows stores zeros
#pragma once

#include <cuda_bf16.h>

#include "kernels/expert_gemm_params.h"
#include "kernels/gemm_mainloop.cuh"
#include "kernels/swiglu.cuh"

namespace mok::kernels {

struct TileCoord {
  int expert;
  int m_tile;  // 128-row tile (of the schedule's rows, or of M for kWeightGrad)
  int n_tile;
  int k_row0;  // first K row (kWeightGrad: the expert's first row)
  int num_k_blocks;
};

__device__ __forceinline__ void store_pair(__nv_bfloat16* address, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(address) = __floats2bfloat162_rn(x, y);
}

template <ExpertGemmForm kForm>
__device__ __forceinline__ void epilogue(const ExpertGemmParams& params, const TileCoord& coord,
                                         int consumer_idx, const float (&acc)[128]) {
  constexpr int kTileN = tile_n_columns(kForm);
  constexpr bool kPairedGateUp = kTileN == 128;
  constexpr int kColumnGroups = kPairedGateUp ? 16 : 32;
  const int row_base = coord.m_tile * BLOCK_M + consumer_idx * 64;
  const int col_base = coord.n_tile * kTileN;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = row_base + fragment_row(i);
    if constexpr (kPairedGateUp) {
      const int64_t offset = static_cast<int64_t>(row) * params.out_ld;
      const bool keeps_gate_up = params.out2 != nullptr;
#pragma unroll
      for (int j = 0; j < kColumnGroups; ++j) {
        const int col = col_base + fragment_col(j);
        if (col >= params.n_extent) continue;
        const float g0 = acc[j * 4 + i * 2], g1 = acc[j * 4 + i * 2 + 1];
        const float u0 = acc[(j + 16) * 4 + i * 2], u1 = acc[(j + 16) * 4 + i * 2 + 1];
        if constexpr (kForm == ExpertGemmForm::kGateUpSwiGLU) {
          store_pair(params.out + offset + col, swiglu_forward(g0, u0, params.swiglu_limit),
                     swiglu_forward(g1, u1, params.swiglu_limit));
          if (keeps_gate_up) {  // the forward context: g, u kept for the backward
            store_pair(params.out2 + offset + col, g0, g1);
            store_pair(params.out3 + offset + col, u0, u1);
          }
        } else {
          store_pair(params.out + offset + col, g0, g1);
          store_pair(params.out2 + offset + col, u0, u1);
        }
      }
    } else {
      static_assert(kForm == ExpertGemmForm::kDownGrad, "unhandled form");
      __nv_bfloat16* out_row = params.out + static_cast<int64_t>(row) * params.out_ld;
#pragma unroll
      for (int j = 0; j < kColumnGroups; ++j) {
        const int col = col_base + fragment_col(j);
        if (col < params.n_extent)
          store_pair(out_row + col, acc[j * 4 + i * 2], acc[j * 4 + i * 2 + 1]);
      }
    }
  }
}

// The staging-tile epilogue. Consumer threads write their fragments into the staging tile
// (four chunks of [128 rows x 64 columns], 128-byte rows swizzled as TMA expects: 16-byte unit
// u of row r sits at u ^ (r % 8), which also makes each warp's writes bank-conflict free), then
// one thread stores the chunks with TMA: to (column, tile row, expert) of out[e] [M, N] for the
// weight gradient, to (column, tile row, 0) of [rows, N] for the row forms. Before overwriting
// the tile, that thread waits until the previous tile's store has read it.
template <ExpertGemmForm kForm, typename Storage>
__device__ __forceinline__ void store_tile(const CUtensorMap* out_map, Storage& smem,
                                           const ExpertGemmParams& params, const TileCoord& coord,
                                           int consumer_idx, const float (&acc)[128]) {
  constexpr int kChunkBytes = BLOCK_M * 128;
  const bool issuer = threadIdx.x == 128;
  if (issuer) ptx::bulk_wait_group_read<0>();
  ptx::named_barrier_sync(1, kConsumerThreads);
  char* tile = reinterpret_cast<char*>(smem.store_tile);
  const bool empty = coord.num_k_blocks == 0;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = consumer_idx * 64 + fragment_row(i);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const int offset =
          (j / 8) * kChunkBytes + row * 128 + (((j % 8) ^ (row % 8)) << 4) + (threadIdx.x % 4) * 4;
      *reinterpret_cast<__nv_bfloat162*>(tile + offset) = __floats2bfloat162_rn(
          empty ? 0.0f : acc[j * 4 + i * 2], empty ? 0.0f : acc[j * 4 + i * 2 + 1]);
    }
  }
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(1, kConsumerThreads);
  if (issuer) {
    const int col_base = coord.n_tile * BLOCK_N;
#pragma unroll
    for (int chunk = 0; chunk < 4; ++chunk)
      if (col_base + chunk * 64 < params.n_extent)
        ptx::tma_store_3d(out_map, tile + chunk * kChunkBytes, col_base + chunk * 64,
                          coord.m_tile * BLOCK_M,
                          kForm == ExpertGemmForm::kWeightGrad ? coord.expert : 0);
    ptx::bulk_commit_group();
  }
}

}  // namespace mok::kernels
