// The down dgrad with the SwiGLU backward in its epilogue (ExpertGemmForm::kDownGradSwiGLU,
// MoeConfig::swiglu_backward_in_dgrad): the standalone SwiGLU pass's work (swiglu_backward.cuh)
// done on the dgrad tile while it is still in the accumulators, so dh_raw is never written nor
// read back.
//
// Roles in expert_gemm.cu's CTA, besides the mainloop's:
//   producer warp 1, lane 0  the loader: walks the CTA's tiles and, subtile by subtile (128 rows
//                 x 32 columns, eight of a 256-column tile), loads g and u by TMA into a ring of
//                 kDgatedBuffers buffers. It runs ahead of the consumers, so while a tile's
//                 mainloop runs it fills the buffers the previous epilogue freed: the tile's
//                 first subtiles are in shared memory before its epilogue begins. (Session 32's
//                 epilogue loaded g and u from global memory with the tensor cores idle, and lost:
//                 docs/design.md, "Epilogue fusions inside the GEMMs".)
//   consumers     per subtile: wait for its g and u; each thread computes the SwiGLU backward of
//                 its accumulator pairs there (dh_raw = bf16(acc), as the kDownGrad store rounds
//                 it), writes d_g over g, d_u over u and h_w into the buffer's third box; then one
//                 named barrier, and the first consumer thread stores the three boxes by TMA and,
//                 once the previous subtile's stores have read their buffer, hands that buffer
//                 back to the loader (subtile_empty).
// The router weights' gradient in the order of swiglu_backward.cuh: a thread holds columns
// 8j + 2q, +1 of vector j (q = lane % 4), so per subtile the four threads of a quad first meet
// on each vector's sum (a reduce-scatter: thread q ends with vector 4s + q), then on the
// subtile's four vectors (the tree's first two levels); the tree's upper levels over the eight
// subtiles stay in registers. The tile's sum is one column tile's partial, summed over column
// tiles after the GEMM (launch_router_weight_grad_sum).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/stages/swiglu.cuh"

namespace mok::kernels {

constexpr int kDgatedSubtileCols = 32;  // 64-byte rows: TMA's 64-byte swizzle
constexpr int kDgatedSubtiles = BLOCK_N / kDgatedSubtileCols;
constexpr int kDgatedBuffers = 3;
constexpr int kDgatedBoxElements = BLOCK_M * kDgatedSubtileCols;
constexpr uint32_t kDgatedBoxBytes = kDgatedBoxElements * 2;
static_assert(kDgatedSubtiles == 8, "the tree over a tile's subtiles below has three levels");

// The mainloop's ring (as GemmSharedStorage<kNumStages>) and, in the staging tile's place, the
// epilogue's buffers: buffer k holds g then d_g, u then d_u, and h_w, each [128 rows x 32
// columns] bf16, 64-byte swizzled (16-byte unit c of row r at c ^ ((r / 2) % 4)). 72 KB against
// the staging tile's 64.
struct alignas(1024) DgatedSharedStorage {
  static constexpr int kNumStagesHere = kNumStages;
  __nv_bfloat16 a[kNumStages][BLOCK_M * BLOCK_K];
  __nv_bfloat16 b[kNumStages][BLOCK_N * BLOCK_K];
  __nv_bfloat16 subtile[kDgatedBuffers][3][kDgatedBoxElements];
  uint64_t full[kNumStages];
  uint64_t empty[kNumStages];
  uint64_t subtile_full[kDgatedBuffers];   // the loader's g and u landed
  uint64_t subtile_empty[kDgatedBuffers];  // the stores have read d_g, d_u and h_w
  alignas(16) unsigned char tail_bytes[kStorageTailBytes];
};
static_assert(kTailInPadding<DgatedSharedStorage>, "the tail bytes cost no room");
static_assert(sizeof(DgatedSharedStorage) + 1024 <= 227 * 1024, "fits the SM's shared memory");

// Thread 0, before init_pipeline (whose fence and barrier publish these too).
__device__ __forceinline__ void init_dgated_barriers(DgatedSharedStorage& smem) {
  for (int k = 0; k < kDgatedBuffers; ++k) {
    ptx::mbarrier_init(&smem.subtile_full[k], 1);
    ptx::mbarrier_init(&smem.subtile_empty[k], 1);
  }
}

// The subtiles of column tile `n_tile`: fewer in a last tile that ends before 256 columns (I is a
// multiple of 64, so each subtile is whole).
__device__ __forceinline__ int dgated_subtiles(int n_extent, int n_tile) {
  const int columns = min(BLOCK_N, n_extent - n_tile * BLOCK_N);
  return (columns + kDgatedSubtileCols - 1) / kDgatedSubtileCols;
}

// Loader: g (map `gate`) and u (map `up`) of one tile's subtiles, in order, into the ring.
// First the subtiles past the ring's depth are asked into L2: the loader reaches this tile while
// the previous tile's epilogue runs, a mainloop before this one's, and its later subtiles' loads
// are issued only as the epilogue frees buffers, one subtile of computing before they are
// needed: from L2 they land in time, from DRAM they would not.
__device__ __forceinline__ void load_dgated_tile(const CUtensorMap* gate, const CUtensorMap* up,
                                                 const ExpertGemmParams& params,
                                                 DgatedSharedStorage& smem,
                                                 PipelineState<kDgatedBuffers>& state,
                                                 const TileCoord& coord) {
  const int row = coord.m_tile * BLOCK_M - params.macrobatch.out_row_base;
  const int subtiles = dgated_subtiles(params.n_extent, coord.n_tile);
  for (int s = kDgatedBuffers; s < subtiles; ++s) {
    const int column = coord.n_tile * BLOCK_N + s * kDgatedSubtileCols;
    ptx::tma_prefetch_l2_3d(gate, column, row, 0);
    ptx::tma_prefetch_l2_3d(up, column, row, 0);
  }
  for (int s = 0; s < subtiles; ++s) {
    mbarrier_wait(params.wait, WaitSite::kEpilogueFree, &smem.subtile_empty[state.stage],
                  state.phase ^ 1);
    uint64_t* full = &smem.subtile_full[state.stage];
    ptx::mbarrier_arrive_expect_tx(full, 2 * kDgatedBoxBytes);
    const int column = coord.n_tile * BLOCK_N + s * kDgatedSubtileCols;
    ptx::tma_load_3d(smem.subtile[state.stage][0], gate, full, column, row, 0);
    ptx::tma_load_3d(smem.subtile[state.stage][1], up, full, column, row, 0);
    state.advance();
  }
}

// A consumer thread's two rows of the tile (fragment rows i = 0, 1): their pairs and weights,
// read before the mainloop so that the loads' latency hides under it.
struct DgatedRows {
  int32_t pair[2];
  float weight[2];
};
__device__ __forceinline__ DgatedRows dgated_rows(const ExpertGemmParams& params,
                                                  const TileCoord& coord, int consumer_idx) {
  DgatedRows rows;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t row =
        static_cast<int64_t>(coord.m_tile) * BLOCK_M + consumer_idx * 64 + fragment_row(i);
    const int32_t pair = params.row_pair[row];
    rows.pair[i] = pair;
    // As swiglu_row_weight: 0 for padding (unused: a padding row's outputs are zeros), 1 without
    // router weights.
    rows.weight[i] = pair < 0                                  ? 0.0f
                     : params.dgated.router_weights != nullptr ? params.dgated.router_weights[pair]
                                                               : 1.0f;
  }
  return rows;
}

// The SwiGLU backward of one accumulator pair (columns 2q, 2q + 1 of a vector) against the bf16
// g and u pairs at `offset` of the buffer's boxes, the outputs written over them (and into
// h_w's box); returns the pair's share of the router dot (e0 + e1, swiglu_backward.cuh's step 1).
// A padding row's outputs are zeros (swiglu_store_padding_vector says why).
__device__ __forceinline__ float dgated_pair(char* gate, char* up, char* hidden, int offset,
                                             float acc0, float acc1, int32_t pair, float weight,
                                             float limit) {
  uint32_t d_gate = 0, d_up = 0, weighted_hidden = 0;
  float pair_dot = 0.0f;
  if (pair >= 0) {
    const float2 g = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(gate + offset));
    const float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(up + offset));
    const SwigluGrad low = swiglu_backward_of_bf16(round_bf16(acc0), g.x, u.x, weight, limit);
    const SwigluGrad high = swiglu_backward_of_bf16(round_bf16(acc1), g.y, u.y, weight, limit);
    pair_dot = low.dh_raw_times_h + high.dh_raw_times_h;
    const __nv_bfloat162 dg = __floats2bfloat162_rn(low.d_gate, high.d_gate);
    const __nv_bfloat162 du = __floats2bfloat162_rn(low.d_up, high.d_up);
    const __nv_bfloat162 hw = __floats2bfloat162_rn(low.weighted_hidden, high.weighted_hidden);
    d_gate = *reinterpret_cast<const uint32_t*>(&dg);
    d_up = *reinterpret_cast<const uint32_t*>(&du);
    weighted_hidden = *reinterpret_cast<const uint32_t*>(&hw);
  }
  *reinterpret_cast<uint32_t*>(gate + offset) = d_gate;
  *reinterpret_cast<uint32_t*>(up + offset) = d_up;
  *reinterpret_cast<uint32_t*>(hidden + offset) = weighted_hidden;
  return pair_dot;
}

// The four threads of a quad hold pair q of each of a subtile's four vectors (pair_dot[c] for
// vector c): returns the subtile's sum, ((V0 + V1) + (V2 + V3)) with V_c = (P_c0 + P_c1) +
// (P_c2 + P_c3), the same in the four threads. First a reduce-scatter (thread q keeps the
// vectors whose bit 0 is q's and adds its neighbour's pair, then the vector c = q and adds the
// other half), then the tree's first two levels.
__device__ __forceinline__ float dgated_subtile_dot(const float (&pair_dot)[4], int quad) {
  const bool odd = (quad & 1) != 0, high = (quad & 2) != 0;
  const float keep0 = odd ? pair_dot[1] : pair_dot[0], send0 = odd ? pair_dot[0] : pair_dot[1];
  const float keep1 = odd ? pair_dot[3] : pair_dot[2], send1 = odd ? pair_dot[2] : pair_dot[3];
  const float half0 = keep0 + __shfl_xor_sync(0xffffffffu, send0, 1);  // vector quad & 1
  const float half1 = keep1 + __shfl_xor_sync(0xffffffffu, send1, 1);  // vector (quad & 1) + 2
  float vector_dot = (high ? half1 : half0) + __shfl_xor_sync(0xffffffffu, high ? half0 : half1, 2);
  vector_dot += __shfl_xor_sync(0xffffffffu, vector_dot, 1);
  vector_dot += __shfl_xor_sync(0xffffffffu, vector_dot, 2);
  return vector_dot;
}

// Consumers: the epilogue of one tile (the file's comment). `state`: the consumers' place in
// the loader's ring.
__device__ __forceinline__ void store_dgated_tile(const OutputMaps& maps, DgatedSharedStorage& smem,
                                                  const ExpertGemmParams& params,
                                                  const TileCoord& coord, int consumer_idx,
                                                  const float (&acc)[128], const DgatedRows& rows,
                                                  PipelineState<kDgatedBuffers>& state) {
  const bool issuer = threadIdx.x == BLOCK_M;  // first consumer thread
  const int quad = threadIdx.x % 4;
  const int out_row = coord.m_tile * BLOCK_M - params.macrobatch.out_row_base;
  const int subtiles = dgated_subtiles(params.n_extent, coord.n_tile);
  // The tree over the subtiles, per row: open[0..2] hold a finished left node of 4, 8 and 16
  // vectors until its right sibling is done.
  float open[2][3];
  float tile_dot[2] = {0.0f, 0.0f};
  int previous_stage = -1;
#pragma unroll
  for (int s = 0; s < kDgatedSubtiles; ++s) {
    float node[2] = {0.0f, 0.0f};  // past the row's end: +0, as the lanes past it give
    if (s < subtiles) {
      mbarrier_wait(params.wait, WaitSite::kEpilogueLoaded, &smem.subtile_full[state.stage],
                    state.phase);
      char* gate = reinterpret_cast<char*>(smem.subtile[state.stage][0]);
      char* up = reinterpret_cast<char*>(smem.subtile[state.stage][1]);
      char* hidden = reinterpret_cast<char*>(smem.subtile[state.stage][2]);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int row = consumer_idx * 64 + fragment_row(i);
        float pair_dot[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int j = 4 * s + c;  // the accumulators' column group (8 columns)
          const int offset = row * 64 + ((c ^ ((row >> 1) & 3)) << 4) + quad * 4;
          pair_dot[c] =
              dgated_pair(gate, up, hidden, offset, acc[j * 4 + i * 2], acc[j * 4 + i * 2 + 1],
                          rows.pair[i], rows.weight[i], params.swiglu_limit);
        }
        node[i] = dgated_subtile_dot(pair_dot, quad);
      }
      ptx::fence_proxy_async_shared();
      ptx::named_barrier_sync(1, kConsumerThreads);
      if (issuer) {
        const int column = coord.n_tile * BLOCK_N + s * kDgatedSubtileCols;
        ptx::tma_store_3d(maps.out, gate, column, out_row, 0);
        ptx::tma_store_3d(maps.out2, up, column, out_row, 0);
        ptx::tma_store_3d(maps.out3, hidden, column, out_row, 0);
        ptx::bulk_commit_group();
        if (previous_stage >= 0) {
          ptx::bulk_wait_group_read<1>();
          ptx::mbarrier_arrive(&smem.subtile_empty[previous_stage]);
        }
      }
      previous_stage = state.stage;
      state.advance();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      // s's bits say which nodes close (s is a constant once unrolled).
      float t = node[i];
      if (s & 1) {
        t = open[i][0] + t;
        if (s & 2) {
          t = open[i][1] + t;
          if (s & 4)
            tile_dot[i] = open[i][2] + t;
          else
            open[i][2] = t;
        } else {
          open[i][1] = t;
        }
      } else {
        open[i][0] = t;
      }
    }
  }
  if (issuer && previous_stage >= 0) {
    ptx::bulk_wait_group_read<0>();
    ptx::mbarrier_arrive(&smem.subtile_empty[previous_stage]);
  }
  float* partials = params.dgated.router_grad_partials;
  if (partials == nullptr || quad != 0) return;
#pragma unroll
  for (int i = 0; i < 2; ++i)
    if (rows.pair[i] >= 0)
      partials[coord.n_tile * params.dgated.partial_rows + out_row + consumer_idx * 64 +
               fragment_row(i)] = tile_dot[i];
}

}  // namespace mok::kernels
