// The down dgrad with the SwiGLU backward in its epilogue (ExpertGemmForm::kDownGradSwiGLU,
// MoeConfig::swiglu_backward_in_dgrad): the standalone SwiGLU pass's work (swiglu_backward.cuh)
// done on the dgrad tile while it is still in the accumulators, so dh_raw is never written nor
// read back.
//
// Roles in expert_gemm.cu's CTA, besides the mainloop's:
//   producer warp 1, lane 0  the loader: walks the CTA's tiles and, subtile by subtile (128 rows
//                 x 32 columns, eight of a 256-column tile), loads g and u by TMA into a ring of
//                 kDgatedBuffers buffers. It runs ahead of the consumers, so while a tile's
//                 mainloop runs it fills the buffers the previous epilogue freed, and it asks the
//                 tile's later subtiles into L2. (Session 32's epilogue loaded g and u from
//                 global memory with the tensor cores idle, and lost: docs/design.md, "Epilogue
//                 fusions inside the GEMMs".)
//   producer warp 2, lane 0  the storer: once the eight consumer warps have written a buffer,
//                 stores its three boxes by TMA and hands it back to the loader as soon as the
//                 stores have read it.
//   consumers     per subtile: wait for its g and u; stage dh_raw = bf16(acc) (the kDownGrad
//                 store's rounding) into the buffer's third box; each thread then takes one
//                 16-byte vector of each of its two fragment rows through the standalone pass's
//                 vector function, writing d_g over g, d_u over u and h_w over dh_raw. A warp
//                 reads back only rows it staged, so __syncwarp is the only wait among the
//                 consumers (named barriers and the storing thread's waits between subtiles took
//                 ~5% of the kernel's warp samples, session 41).
// Only the staging indexes the accumulators (unrolled per subtile, one compare each); the SwiGLU
// arithmetic is one loop body for all subtiles: fully unrolled, the epilogue's ~6,000
// instructions a warp stalled on instruction fetch (session 41, ncu: 38% of its samples).
// The router weights' gradient in the order of swiglu_backward.cuh: a row's four vectors of a
// subtile sit in one quad of lanes, which adds them as the tree's first two levels; the upper
// levels over the eight subtiles stay in registers; the tile's sum is one column tile's partial,
// summed over column tiles after the GEMM (launch_router_weight_grad_sum).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <utility>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/stages/swiglu_backward.cuh"

namespace mok::kernels {

constexpr int kDgatedSubtileCols = 32;  // 64-byte rows: TMA's 64-byte swizzle
constexpr int kDgatedSubtiles = BLOCK_N / kDgatedSubtileCols;
constexpr int kDgatedBuffers = 3;  // the ring: g (then d_g), u (then d_u), dh_raw (then h_w)
constexpr int kDgatedBoxElements = BLOCK_M * kDgatedSubtileCols;
constexpr uint32_t kDgatedBoxBytes = kDgatedBoxElements * 2;
static_assert(kDgatedSubtiles == 8, "the tree over a tile's subtiles below has three levels");

// The mainloop's ring (as GemmSharedStorage<kNumStages>) and, in the staging tile's place, the
// epilogue's ring of buffers, each three boxes of [128 rows x 32 columns] bf16, 64-byte swizzled
// (16-byte unit c of row r at c ^ ((r / 2) % 4)): g then d_g over it, u then d_u, dh_raw then
// h_w. 72 KB against the staging tile's 64.
struct alignas(1024) DgatedSharedStorage {
  static constexpr int kNumStagesHere = kNumStages;
  __nv_bfloat16 a[kNumStages][BLOCK_M * BLOCK_K];
  __nv_bfloat16 b[kNumStages][BLOCK_N * BLOCK_K];
  __nv_bfloat16 subtile[kDgatedBuffers][3][kDgatedBoxElements];
  uint64_t full[kNumStages];
  uint64_t empty[kNumStages];
  uint64_t subtile_full[kDgatedBuffers];   // loader -> consumers: g and u landed
  uint64_t subtile_done[kDgatedBuffers];   // consumers -> storer: d_g, d_u, h_w written
  uint64_t subtile_empty[kDgatedBuffers];  // storer -> loader: the stores have read them
  alignas(16) unsigned char tail_bytes[kStorageTailBytes];
};
static_assert(kTailInPadding<DgatedSharedStorage>, "the tail bytes cost no room");
static_assert(sizeof(DgatedSharedStorage) + 1024 <= 227 * 1024, "fits the SM's shared memory");

// Thread 0, before init_pipeline (whose fence and barrier publish these too).
__device__ __forceinline__ void init_dgated_barriers(DgatedSharedStorage& smem) {
  for (int k = 0; k < kDgatedBuffers; ++k) {
    ptx::mbarrier_init(&smem.subtile_full[k], 1);
    ptx::mbarrier_init(&smem.subtile_done[k], kConsumerThreads / 32);
    ptx::mbarrier_init(&smem.subtile_empty[k], 1);
  }
}

// The subtiles of column tile `n_tile`: fewer in a last tile that ends before 256 columns (I is a
// multiple of 64, so each subtile is whole).
__device__ __forceinline__ int dgated_subtiles(int n_extent, int n_tile) {
  const int columns = min(BLOCK_N, n_extent - n_tile * BLOCK_N);
  return (columns + kDgatedSubtileCols - 1) / kDgatedSubtileCols;
}

// Byte offset of 16-byte unit `unit` (0-3) of row `row` in a box (the 64-byte swizzle).
__device__ __forceinline__ int dgated_box_offset(int row, int unit) {
  return row * 64 + ((unit ^ ((row >> 1) & 3)) << 4);
}

// Where a tile's [rows, I] operands and outputs sit: its first row in the buffers (a
// macrobatch's ring rows), and subtile s's first column.
__device__ __forceinline__ int dgated_first_row(const ExpertGemmParams& params,
                                                const TileCoord& coord) {
  return coord.m_tile * BLOCK_M - params.macrobatch.out_row_base;
}
__device__ __forceinline__ int dgated_column(const TileCoord& coord, int subtile) {
  return coord.n_tile * BLOCK_N + subtile * kDgatedSubtileCols;
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
  const int row = dgated_first_row(params, coord);
  const int subtiles = dgated_subtiles(params.n_extent, coord.n_tile);
  for (int s = kDgatedBuffers; s < subtiles; ++s) {
    const int column = dgated_column(coord, s);
    ptx::tma_prefetch_l2_3d(gate, column, row, 0);
    ptx::tma_prefetch_l2_3d(up, column, row, 0);
  }
  for (int s = 0; s < subtiles; ++s) {
    mbarrier_wait(params.wait, WaitSite::kEpilogueFree, &smem.subtile_empty[state.stage],
                  state.phase ^ 1);
    uint64_t* full = &smem.subtile_full[state.stage];
    ptx::mbarrier_arrive_expect_tx(full, 2 * kDgatedBoxBytes);
    const int column = dgated_column(coord, s);
    ptx::tma_load_3d(smem.subtile[state.stage][0], gate, full, column, row, 0);
    ptx::tma_load_3d(smem.subtile[state.stage][1], up, full, column, row, 0);
    state.advance();
  }
}

// A consumer thread's two rows in the SwiGLU walk: its fragment rows (i = 0, 1), so that a warp
// reads back only the rows it staged. Their pairs are read before the mainloop and their
// weights (a load that waits for the pair) when the epilogue begins, so neither load's
// latency holds up a tile.
struct DgatedRows {
  int32_t pair[2];
  float weight[2];
};
__device__ __forceinline__ int dgated_row(int consumer_idx, int k) {
  return consumer_idx * 64 + fragment_row(k);
}
__device__ __forceinline__ DgatedRows dgated_pairs(const ExpertGemmParams& params,
                                                   const TileCoord& coord, int consumer_idx) {
  DgatedRows rows;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    rows.pair[k] =
        params.row_pair[static_cast<int64_t>(coord.m_tile) * BLOCK_M + dgated_row(consumer_idx, k)];
    rows.weight[k] = 0.0f;
  }
  return rows;
}
// As swiglu_row_weight: 0 for padding (unused: a padding row's outputs are zeros), 1 without
// router weights.
__device__ __forceinline__ void dgated_weights(const ExpertGemmParams& params, DgatedRows& rows) {
#pragma unroll
  for (int k = 0; k < 2; ++k)
    rows.weight[k] = rows.pair[k] < 0 ? 0.0f
                     : params.dgated.router_weights != nullptr
                         ? params.dgated.router_weights[rows.pair[k]]
                         : 1.0f;
}

// dh_raw = bf16(acc) of subtile kSubtile's columns into `box`: a thread's accumulator pairs
// (columns 8j + 2q, +1 of its fragment rows) as 4-byte stores, which the swizzle spreads over
// the 32 banks. Only this step indexes the accumulators, so only it is unrolled per subtile.
template <int kSubtile>
__device__ __forceinline__ void stage_dh_raw(char* box, const float (&acc)[128], int consumer_idx) {
  const int quad = threadIdx.x % 4;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = dgated_row(consumer_idx, i);
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int j = 4 * kSubtile + c;
      *reinterpret_cast<__nv_bfloat162*>(box + dgated_box_offset(row, c) + quad * 4) =
          __floats2bfloat162_rn(acc[j * 4 + i * 2], acc[j * 4 + i * 2 + 1]);
    }
  }
}
// stage_dh_raw of a runtime subtile index: one compare and call per subtile.
template <int... kSubtiles>
__device__ __forceinline__ void stage_dh_raw_of(int subtile, char* box, const float (&acc)[128],
                                                int consumer_idx,
                                                std::integer_sequence<int, kSubtiles...>) {
  ((subtile == kSubtiles ? stage_dh_raw<kSubtiles>(box, acc, consumer_idx) : void()), ...);
}

// One subtile's SwiGLU backward by a consumer thread: unit q = lane % 4 of its two rows (the
// rows its warp staged, so __syncwarp is the only wait) through the standalone pass's vector
// function (the same bits), the outputs written over their inputs (d_g over g, d_u over u, h_w
// over dh_raw). node[k]: the subtile's share of row k's router dot, the quad's four vectors
// added as the tree's first two levels.
__device__ __forceinline__ void dgated_subtile(char* gate, char* up, char* hidden,
                                               const DgatedRows& rows, int consumer_idx,
                                               float limit, float (&node)[2]) {
  const int unit = threadIdx.x % 4;
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int offset = dgated_box_offset(dgated_row(consumer_idx, k), unit);
    const uint4 g = ptx::ld_shared_v4(gate + offset), u = ptx::ld_shared_v4(up + offset),
                dh = ptx::ld_shared_v4(hidden + offset);
    uint4 d_gate = make_uint4(0, 0, 0, 0), d_up = d_gate, weighted_hidden = d_gate;
    float vector_dot = 0.0f;  // a padding row: zeros (swiglu_store_padding_vector says why)
    if (rows.pair[k] >= 0)
      swiglu_backward_vector(g, u, dh, rows.weight[k], limit, vector_dot, d_gate, d_up,
                             weighted_hidden);
    *reinterpret_cast<uint4*>(gate + offset) = d_gate;
    *reinterpret_cast<uint4*>(up + offset) = d_up;
    *reinterpret_cast<uint4*>(hidden + offset) = weighted_hidden;
    node[k] = router_dot_group<4>(vector_dot);
  }
}

// The tree over a tile's eight subtiles, per row: open[0..2] hold a finished left node of 4, 8
// and 16 vectors until its right sibling is done; subtile s's bits say which nodes close.
struct DgatedTree {
  float open[2][3];
  float tile_dot[2] = {0.0f, 0.0f};
  __device__ __forceinline__ void add(int subtile, const float (&node)[2]) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      float t = node[k];
      if (subtile & 1) {
        t = open[k][0] + t;
        if (subtile & 2) {
          t = open[k][1] + t;
          if (subtile & 4)
            tile_dot[k] = open[k][2] + t;
          else
            open[k][2] = t;
        } else {
          open[k][1] = t;
        }
      } else {
        open[k][0] = t;
      }
    }
  }
};

// Storer (producer warp 2, lane 0): one tile's subtiles, in the consumers' order: once the eight
// consumer warps have written a buffer, its three boxes to d_g (out), d_u (out2) and h_w (out3),
// and the buffer back to the loader as soon as the stores have read it. The caller waits for
// the last stores' writes before the kernel ends.
__device__ __forceinline__ void store_dgated_subtiles(const OutputMaps& maps,
                                                      const ExpertGemmParams& params,
                                                      DgatedSharedStorage& smem,
                                                      PipelineState<kDgatedBuffers>& state,
                                                      const TileCoord& coord) {
  const int row = dgated_first_row(params, coord);
  const int subtiles = dgated_subtiles(params.n_extent, coord.n_tile);
  for (int s = 0; s < subtiles; ++s) {
    mbarrier_wait(params.wait, WaitSite::kEpilogueWritten, &smem.subtile_done[state.stage],
                  state.phase);
    const int column = dgated_column(coord, s);
    ptx::tma_store_3d(maps.out, smem.subtile[state.stage][0], column, row, 0);
    ptx::tma_store_3d(maps.out2, smem.subtile[state.stage][1], column, row, 0);
    ptx::tma_store_3d(maps.out3, smem.subtile[state.stage][2], column, row, 0);
    ptx::bulk_commit_group();
    ptx::bulk_wait_group_read<0>();
    ptx::mbarrier_arrive(&smem.subtile_empty[state.stage]);
    state.advance();
  }
}

// Consumers: the epilogue of one tile (the file's comment). No barrier among the consumers: per
// subtile each warp waits for its g and u, stages and reads back its own rows, and tells the
// storer it is done. `state`: the consumers' place in the ring.
__device__ __forceinline__ void dgated_epilogue(DgatedSharedStorage& smem,
                                                const ExpertGemmParams& params,
                                                const TileCoord& coord, int consumer_idx,
                                                const float (&acc)[128], DgatedRows rows,
                                                PipelineState<kDgatedBuffers>& state) {
  dgated_weights(params, rows);
  const int subtiles = dgated_subtiles(params.n_extent, coord.n_tile);
  DgatedTree tree;
#pragma unroll 1
  for (int s = 0; s < subtiles; ++s) {
    mbarrier_wait(params.wait, WaitSite::kEpilogueLoaded, &smem.subtile_full[state.stage],
                  state.phase);
    char* gate = reinterpret_cast<char*>(smem.subtile[state.stage][0]);
    char* up = reinterpret_cast<char*>(smem.subtile[state.stage][1]);
    char* hidden = reinterpret_cast<char*>(smem.subtile[state.stage][2]);
    stage_dh_raw_of(s, hidden, acc, consumer_idx,
                    std::make_integer_sequence<int, kDgatedSubtiles>{});
    __syncwarp();
    float node[2];
    dgated_subtile(gate, up, hidden, rows, consumer_idx, params.swiglu_limit, node);
    tree.add(s, node);
    ptx::fence_proxy_async_shared();  // this thread's writes, before the storer's TMA reads
    __syncwarp();
    if (threadIdx.x % 32 == 0) ptx::mbarrier_arrive(&smem.subtile_done[state.stage]);
    state.advance();
  }
  const float zero[2] = {0.0f, 0.0f};  // subtiles past the row's end: +0, as lanes past it give
#pragma unroll 1
  for (int s = subtiles; s < kDgatedSubtiles; ++s) tree.add(s, zero);
  float* partials = params.dgated.router_grad_partials;
  if (partials == nullptr || threadIdx.x % 4 != 0) return;
  const int out_row = dgated_first_row(params, coord);
#pragma unroll
  for (int k = 0; k < 2; ++k)
    if (rows.pair[k] >= 0)
      partials[coord.n_tile * params.dgated.partial_rows + out_row + dgated_row(consumer_idx, k)] =
          tree.tile_dot[k];
}

}  // namespace mok::kernels
