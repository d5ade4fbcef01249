// The forward gate/up GEMM's SwiGLU handed to a producer warp (MoeConfig::swiglu_handoff,
// kGateUpSwiGLU in expert_gemm.cu without CTA pairs or the deep ring).
//
// Without it the consumer warpgroups run the whole epilogue: stage bf16(g) and bf16(u), store
// them, compute h = swiglu(g, u) from the staged values (an exponential and a division per
// output), wait for the store to read the tile, write h and store it. The tensor cores idle
// through all of it. With it the epilogue splits in two:
//   consumers       wait until the staging tile is free (swiglu_free), stage bf16(g) and
//                   bf16(u) as before, make them visible to the async proxy, arrive on
//                   swiglu_staged, and go back to the next tile's mainloop.
//   producer warp 1 (the SwiGLU warp; warps 2-3 keep gathering rows when the local dispatch is
//                   fused) walks the same tiles: waits on swiglu_staged, stores g and u (the
//                   forward context), waits for that store to read the tile, computes h unit by
//                   unit in place over g, stores h, waits for that store to read the tile, and
//                   arrives on swiglu_free.
// The staging tile, its layout and every value are the consumers' own path's: h depends only on
// bf16(g) and bf16(u), computed by the same swiglu_forward_unit, so the bits are the same.
// Phases: each barrier completes once per tile of the CTA, so tile t waits on parity t & 1.
#pragma once

#include <cuda.h>

#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/stages/swiglu.cuh"

namespace mok::kernels {

constexpr int kSwigluWarpThreads = 32;

// Consumers: tile `tile_count` (0, 1, ... of this CTA) into the staging tile, handed to the
// SwiGLU warp. The first consumer thread waits for the tile before it to be released.
template <typename Storage>
__device__ __forceinline__ void hand_off_gate_up_tile(const WaitContext& wait, Storage& smem,
                                                      const TileCoord& coord, int consumer_idx,
                                                      const float (&acc)[128], int tile_count) {
  const bool leader = threadIdx.x == BLOCK_M;  // first consumer thread
  if (leader && tile_count > 0)
    mbarrier_wait(wait, WaitSite::kSwigluFree, &smem.swiglu_free, (tile_count - 1) & 1);
  ptx::named_barrier_sync(1, kConsumerThreads);
  stage_accumulators(
      reinterpret_cast<char*>(smem.store_tile), consumer_idx, coord.half,
      [&](int i, int j) { return make_float2(acc[j * 4 + i * 2], acc[j * 4 + i * 2 + 1]); });
  ptx::fence_proxy_async_shared();
  ptx::named_barrier_sync(1, kConsumerThreads);
  if (leader) ptx::mbarrier_arrive(&smem.swiglu_staged);
}

// The SwiGLU warp: one staged tile. Lane 0 issues the stores; every lane computes h over its
// units (lane l: units l + 32 q of the gate chunks 0-1, 2048 in all, 64 per lane).
template <typename Storage>
__device__ __forceinline__ void serve_swiglu_tile(const OutputMaps& maps, Storage& smem,
                                                  const ExpertGemmParams& params,
                                                  const TileCoord& coord, int tile_count) {
  const int lane = threadIdx.x % 32;
  char* tile = reinterpret_cast<char*>(smem.store_tile);
  const int col_base = coord.n_tile * 128;
  const int row = coord.m_tile * BLOCK_M - params.macrobatch.out_row_base;
  mbarrier_wait(params.wait, WaitSite::kSwigluStaged, &smem.swiglu_staged, tile_count & 1);
  if (lane == 0) {
    store_chunks(maps.out2, tile, 0, 2, col_base, params.n_extent, row, 0);
    store_chunks(maps.out3, tile, 2, 2, col_base, params.n_extent, row, 0);
    ptx::bulk_commit_group();
    ptx::bulk_wait_group_read<0>();  // h goes over g: the store must have read g first
  }
  __syncwarp();
  constexpr int kUnits = 2 * BLOCK_M * 8;
  for (int unit = lane; unit < kUnits; unit += kSwigluWarpThreads) {
    const int chunk = unit / (BLOCK_M * 8), tile_row = (unit / 8) % BLOCK_M;
    uint4* gate_unit = reinterpret_cast<uint4*>(tile + chunk * kStageChunkBytes + tile_row * 128 +
                                                (((unit % 8) ^ (tile_row % 8)) << 4));
    const uint4 gate = *gate_unit;
    const uint4 up = *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(gate_unit) +
                                                     2 * kStageChunkBytes);
    uint4 h;
    if (!swiglu_forward_unit<true>(gate, up, params.swiglu_limit, h))
      swiglu_forward_unit<false>(gate, up, params.swiglu_limit, h);
    *gate_unit = h;
  }
  ptx::fence_proxy_async_shared();
  __syncwarp();
  if (lane == 0) {
    store_chunks(maps.out, tile, 0, 2, col_base, params.n_extent, row, 0);
    ptx::bulk_commit_group();
    ptx::bulk_wait_group_read<0>();
    ptx::mbarrier_arrive(&smem.swiglu_free);
  }
}

}  // namespace mok::kernels
