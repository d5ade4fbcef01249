// The persistent backward's SwiGLU task (backward_gemms.cu): the SwiGLU backward of one 128-row
// tile, its g, u and dh_raw rows streamed by TMA through the GEMM's stage ring.
//
// Why TMA: the consumer warps that run the task keep 128 accumulator registers live, so loading
// rows with plain loads left only a few in flight per warp: ~380 us per tile at dsv3_local
// (8 GB/s on its SM, traced), against ~150 us per tile for the standalone pass. Through the ring
// the producer keeps three 48 KB stages in flight, as for a GEMM tile.
//
// Stage (row block rb, column group c) holds rows [32 rb, 32 rb + 32) of the tile and columns
// [256 c, 256 c + 256) of g (in the stage's A tile), u (the first half of B) and dh_raw (the
// second half), each as four TMA boxes of [32 rows x 64 columns], 128-byte swizzled, 4 KB apart.
// Stages run row block by row block, column groups in order within each.
// Consumer warp w (0-7) takes rows 4w .. 4w + 3 of each row block; lane l takes vector l of the
// 32 16-byte vectors of each column group, as swiglu_backward_row does, so the router weights'
// gradients have the standalone pass's bits: each group's tree by the warp's shuffles, the
// groups added in column order in the lanes' registers.
// d_g, d_u and h_w (over dh_raw's own rows, which this task alone reads) leave by plain stores.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/common/ptx.cuh"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/stages/swiglu_backward.cuh"

namespace mok::kernels {

constexpr int kSwigluBlockRows = 32;      // rows of a stage
constexpr int kSwigluGroupColumns = 256;  // columns of a stage: one 16-byte vector per lane
constexpr int kSwigluBoxBytes = kSwigluBlockRows * 64 * 2;  // one [32 x 64] bf16 box
static_assert(3 * 4 * kSwigluBoxBytes == kTileABytes + kTileBBytes, "a stage holds g, u, dh");
static_assert(kSwigluBlockRows * 8 / 2 == BLOCK_M, "8 consumer warps x 4 rows per row block");

__device__ __forceinline__ int swiglu_column_groups(int64_t intermediate) {
  return static_cast<int>((intermediate + kSwigluGroupColumns - 1) / kSwigluGroupColumns);
}

// The stages of a SwiGLU task: 4 row blocks x its column groups.
__device__ __forceinline__ int swiglu_task_stages(int64_t intermediate) {
  return (BLOCK_M / kSwigluBlockRows) * swiglu_column_groups(intermediate);
}

// 64-column boxes of column group `group` inside the row (the last group may be short).
__device__ __forceinline__ int swiglu_group_boxes(int64_t intermediate, int group) {
  const int64_t rest = intermediate - static_cast<int64_t>(group) * kSwigluGroupColumns;
  return rest >= kSwigluGroupColumns ? 4 : static_cast<int>((rest + 63) / 64);
}

// The bytes stage `stage_idx` of a SwiGLU task loads.
__device__ __forceinline__ uint32_t swiglu_stage_bytes(int64_t intermediate, int stage_idx) {
  const int group = stage_idx % swiglu_column_groups(intermediate);
  return 3u * swiglu_group_boxes(intermediate, group) * kSwigluBoxBytes;
}

// Producer: the TMA loads of stage `stage_idx` of row tile `m_tile` (maps over [rows, I] with
// [32 x 64] boxes; rows at schedule row - ring_row_base).
__device__ __forceinline__ void issue_swiglu_loads(const CUtensorMap* gate, const CUtensorMap* up,
                                                   const CUtensorMap* dh_raw, int64_t intermediate,
                                                   int m_tile, int ring_row_base, int stage_idx,
                                                   __nv_bfloat16* a_dst, __nv_bfloat16* b_dst,
                                                   uint64_t* full) {
  const int groups = swiglu_column_groups(intermediate);
  const int row_block = stage_idx / groups, group = stage_idx % groups;
  const int row = m_tile * BLOCK_M + row_block * kSwigluBlockRows - ring_row_base;
  constexpr int kBoxElements = kSwigluBoxBytes / 2;
  for (int box = 0; box < swiglu_group_boxes(intermediate, group); ++box) {
    const int column = group * kSwigluGroupColumns + box * 64;
    ptx::tma_load_2d(a_dst + box * kBoxElements, gate, full, column, row);
    ptx::tma_load_2d(b_dst + box * kBoxElements, up, full, column, row);
    ptx::tma_load_2d(b_dst + (4 + box) * kBoxElements, dh_raw, full, column, row);
  }
}

// swiglu_backward_vector out of line: inlined, its registers on top of the accumulators (live
// across tasks in ptxas's view) made the kernel's mainloops spill (SASS: one local load per
// K-block). Operands and results by value, so the call passes them in registers.
struct SwigluVectorOut {
  uint4 d_gate, d_up, weighted_hidden;
  float vector_dot;
};
// A padding row's vector is zeros (swiglu_backward.cuh: swiglu_store_padding_vector says why).
static __device__ __noinline__ SwigluVectorOut swiglu_vector_out_of_line(uint4 g, uint4 u, uint4 dh,
                                                                         float weight, float limit,
                                                                         bool padding) {
  SwigluVectorOut out;
  if (padding) {
    out.d_gate = out.d_up = out.weighted_hidden = make_uint4(0, 0, 0, 0);
    out.vector_dot = 0.0f;
    return out;
  }
  swiglu_backward_vector(g, u, dh, weight, limit, out.vector_dot, out.d_gate, out.d_up,
                         out.weighted_hidden);
  return out;
}

// Consumer warps (all eight): the SwiGLU backward of row tile `m_tile` from the stages the
// producer fills in the order above, releasing each stage after reading it. Rows at or past
// `total_rows` are skipped, as the standalone pass does.
template <typename Storage, typename State>
__device__ __forceinline__ void run_swiglu_tile(const WaitContext& wait, Storage& smem,
                                                State& state, const SwigluBackwardArgs& args,
                                                int m_tile, int64_t total_rows) {
  const int warp = (threadIdx.x - kNumThreads + kConsumerThreads) / 32;  // 0-7
  const int lane = threadIdx.x % 32;
  const int box = lane / 8, chunk = lane % 8;
  const int64_t intermediate = args.vectors_per_row * 8;
  const int groups = swiglu_column_groups(intermediate);
  for (int row_block = 0; row_block < BLOCK_M / kSwigluBlockRows; ++row_block) {
    const int first_local_row = warp * 4;  // within the row block
    const int64_t first_row =
        static_cast<int64_t>(m_tile) * BLOCK_M + row_block * kSwigluBlockRows + first_local_row;
    int pair[4];
    float weight[4], dot[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int64_t row = first_row + i;
      pair[i] = row >= total_rows          ? -1
                : args.row_pair != nullptr ? args.row_pair[row]
                                           : static_cast<int>(row);
      weight[i] = swiglu_row_weight(args, pair[i]);
      dot[i] = 0.0f;
    }
    for (int group = 0; group < groups; ++group) {
      mbarrier_wait(wait, WaitSite::kGemmLoadedStage, &smem.full[state.stage], state.phase);
      const char* gate = reinterpret_cast<const char*>(smem.a[state.stage]);
      const char* up = reinterpret_cast<const char*>(smem.b[state.stage]);
      const char* dh_raw = up + 4 * kSwigluBoxBytes;
      const int64_t vector = static_cast<int64_t>(group) * 32 + lane;
      const bool in_row = vector < args.vectors_per_row;
      // Row by row: its inputs by shared-memory loads (which the global stores cannot alias;
      // generic loads interleaved with the stores serialized the rows, SASS), then its math;
      // the stage goes back to the producer after the last row's loads. More rows' inputs at
      // once spilled beside the accumulators.
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        uint4 gate_in, up_in, dh_in;
        if (in_row) {
          const int local_row = first_local_row + r;
          // 128-byte swizzle: 16-byte chunk j of a box row r sits at chunk j ^ (r % 8).
          const int offset =
              box * kSwigluBoxBytes + local_row * 128 + ((chunk ^ (local_row % 8)) * 16);
          gate_in = ptx::ld_shared_v4(gate + offset);
          up_in = ptx::ld_shared_v4(up + offset);
          dh_in = ptx::ld_shared_v4(dh_raw + offset);
        }
        if (r == 3) {
          __syncwarp();
          if (lane == 0) ptx::mbarrier_arrive(&smem.empty[state.stage]);
        }
        const int64_t row = first_row + r;
        if (row >= total_rows) continue;  // the whole warp's row
        float vector_dot = 0.0f;          // past the row's end: +0 in the group's tree
        if (in_row) {
          const int64_t at = (row - args.row_begin) * args.vectors_per_row + vector;
          const SwigluVectorOut out =
              swiglu_vector_out_of_line(gate_in, up_in, dh_in, weight[r], args.limit, pair[r] < 0);
          vector_dot = out.vector_dot;
          args.d_gate[at] = out.d_gate;
          args.d_up[at] = out.d_up;
          args.weighted_hidden[at] = out.weighted_hidden;
        }
        dot[r] += router_dot_group(vector_dot);
      }
      state.advance();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
      if (first_row + i < total_rows && pair[i] >= 0 && lane == 0)
        store_router_weight_grad(args, pair[i], dot[i]);
  }
}

}  // namespace mok::kernels
