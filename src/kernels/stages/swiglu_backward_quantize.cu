// The FP8 backward's SwiGLU with its outputs quantized in the same pass
// (swiglu_backward_quantize.h). The three passes it replaces moved ~1.15 GB at qwen3 (the
// SwiGLU backward's g, u, dh_raw in and d_g, d_u, h_w out in bf16, then d_g, d_u and h_w read
// back for their codes); this one reads g, u and dh_raw once and writes only codes and scales.
//
// Grid: 256-thread CTAs (2 an SM: three staged tiles and the column scratch, 105 KB), x: the
// 128-row tiles, y: runs of I's 256-column groups (one run, the whole of I, unless the launcher
// splits I where the tiles alone would leave a wave nearly empty:
// swiglu_backward_quantize_splits). The CTA walks its run's I columns in chunks of 128:
//   0. each thread copies (cp.async, no registers) its vectors of g, u and dh_raw into three
//      staged bf16 tiles (fp8_group_tile.cuh): slot threadIdx % 16 of the chunk, rows
//      threadIdx / 16 + 16 k, g where d_g will go, u where d_u, dh_raw where h_w;
//   1. each thread waits for its own copies and computes its 8-element vectors
//      (swiglu_backward.cuh) in place: d_g, d_u and h_w over the operands they came from;
//   2. the tiles are quantized from 8 x 8 register blocks (fp8_register_block.cuh), tile by
//      tile: d_g and d_u in row groups and column groups, h_w in column groups (the column codes
//      transposed through the tile's own memory);
//      as each tile's codes have left, the next chunk's operand is copied into it (step 0), so
//      those copies run under the rest of the quantization.
// The router weight's gradient, in the order of swiglu_backward.cuh: a 256-column group is chunks
// 2t and 2t + 1, its vector 16 c + s (slot s of chunk c) in the standalone pass's lane
// 16 (c % 2) + s. The 16 slots of a row are one half-warp, so each chunk's half of the group's
// tree is the half-warp's butterfly over lanes 1-8; the even chunk's half waits in a register
// for the odd one's, and their sum (the tree's last level) joins the row's running sum. Split
// (kGroupPartials), each group's sum goes to the router partials instead, and
// launch_router_weight_grad_sum adds them in the same order after the kernel.
#include <cuda_bf16.h>
#include <cuda_pipeline_primitives.h>

#include "kernels/common/kernel_stream.h"
#include "kernels/common/overlapped_launch.h"
#include "kernels/common/ptx.cuh"
#include "kernels/stages/fp8_group_tile.cuh"
#include "kernels/stages/fp8_register_block.cuh"
#include "kernels/stages/launch.h"
#include "kernels/stages/swiglu_backward.cuh"
#include "kernels/stages/swiglu_backward_quantize.h"

namespace mok::kernels {

namespace {

using namespace fp8_tile;  // the staged tile (fp8_group_tile.cuh)

constexpr int kSlots = kTile / 8;                          // 8-element vectors per row of a chunk
constexpr int kRowsPerThread = kTile * kSlots / kThreads;  // 8
constexpr int kRowStride = kThreads / kSlots;              // 16: a thread's rows are this far apart
constexpr int32_t kPastTheRows = -2;                       // a tile row at or past total_rows

struct SwigluBackwardTiles {
  StagedTile d_gate, d_up, h_w;
  fp8_register_block::ColumnScratch column_scratch;  // the column groups' maxima and inverses
};
// CTAs an SM holds: the staged tiles bind (the launch bounds promise the registers for it), so
// the launcher sizes its waves from this, not from an occupancy query per launch.
constexpr int kCtasPerSm = 2;
static_assert(kCtasPerSm * (sizeof(SwigluBackwardTiles) + 2 * 1024) <= 228 * 1024,
              "the staged tiles of kCtasPerSm CTAs (with their static and reserved shared "
              "memory) fit an SM");
static_assert(kSlots == 16, "a chunk is half of a 256-column group: one half-warp per row");

// Row `row` of the tile's sum over 256-column group `group` into the partials (a routed row's,
// by its slot-0 thread), for launch_router_weight_grad_sum.
__device__ __forceinline__ void store_group_partial(float* partials, int64_t capacity_rows,
                                                    int64_t row0, int row, int64_t group,
                                                    const int32_t* pairs, float value) {
  if (threadIdx.x % kSlots == 0 && pairs[row] >= 0)
    partials[group * capacity_rows + row0 + row] = value;
}

// The copies of one operand's vectors of chunk `chunk` (the thread's rows; none for padding
// rows and rows past total_rows) into `tile`, at the places its output takes: one commit group.
__device__ __forceinline__ void copy_operand(const uint4* operand, const Fp8SwigluBackward& p,
                                             int64_t row0, int64_t chunk, const int32_t* pairs,
                                             StagedTile& tile) {
  const int slot = threadIdx.x % kSlots, first = threadIdx.x / kSlots;
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int row = first + kRowStride * k;
    if (pairs[row] < 0) continue;
    __pipeline_memcpy_async(
        &tile[row][slot * 8],
        operand + (row0 + row) * p.swiglu.vectors_per_row + chunk * kSlots + slot, sizeof(uint4));
  }
  __pipeline_commit();
}

// The thread's vectors of chunk `chunk`, their g, u and dh_raw already copied into the three
// tiles (copy_operand, by this thread: no barrier needed), computed in place (each element read
// before it is written; zeros for padding rows and rows past total_rows). dots[k][0]: row k's
// sum over the groups done; dots[k][1]: the open group's even half. With `partials`
// (kGroupPartials: the CTA takes a run of the groups), each closed group's sum goes there instead.
template <bool kGroupPartials>
__device__ __forceinline__ void compute_vectors(const Fp8SwigluBackward& p, int64_t row0,
                                                int64_t chunk, const int32_t* pairs,
                                                const float* weights,
                                                float (&dots)[kRowsPerThread][2],
                                                SwigluBackwardTiles& tiles) {
  const SwigluBackwardArgs& args = p.swiglu;
  const int slot = threadIdx.x % kSlots, first = threadIdx.x / kSlots;
  const bool odd = chunk % 2 != 0;
  __pipeline_wait_prior(0);
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) {
    const int row = first + kRowStride * k;
    uint4* dg_at = reinterpret_cast<uint4*>(&tiles.d_gate[row][slot * 8]);
    uint4* du_at = reinterpret_cast<uint4*>(&tiles.d_up[row][slot * 8]);
    uint4* hw_at = reinterpret_cast<uint4*>(&tiles.h_w[row][slot * 8]);
    uint4 dg = make_uint4(0, 0, 0, 0), du = dg, hw = dg;
    float vector_dot = 0.0f;
    if (pairs[row] >= 0)
      swiglu_backward_vector(*dg_at, *du_at, *hw_at, weights[row], args.limit, vector_dot, dg, du,
                             hw);
    const float half = router_dot_group<kSlots>(vector_dot);  // every lane: the shuffles
    if (!odd) {
      dots[k][1] = half;
    } else if constexpr (kGroupPartials) {
      store_group_partial(p.router_grad_partials, p.capacity_rows, row0, row, chunk / 2, pairs,
                          dots[k][1] + half);
    } else {
      dots[k][0] += dots[k][1] + half;
    }
    *dg_at = dg;
    *du_at = du;
    *hw_at = hw;
  }
}

// Chunk `chunk` of the CTA's rows, its operands' copies in flight: computed, then quantized
// into every output given. As each tile's last reader is done, the next chunk's operand that
// lands there (`next` < chunk_end) is copied in, so the copies run under the quantization.
template <bool kGroupPartials>
__device__ __forceinline__ void swiglu_backward_chunk(const Fp8SwigluBackward& p, int64_t row0,
                                                      int64_t chunk, int64_t chunk_end,
                                                      const int32_t* pairs, const float* weights,
                                                      float (&dots)[kRowsPerThread][2],
                                                      SwigluBackwardTiles& tiles) {
  compute_vectors<kGroupPartials>(p, row0, chunk, pairs, weights, dots, tiles);
  __syncthreads();
  const SwigluBackwardArgs& args = p.swiglu;
  const int64_t tile_row = row0 / kTile, inter = args.vectors_per_row * 8, next = chunk + 1;
  auto copy_next = [&](const uint4* operand, StagedTile& tile) {
    __syncthreads();  // the tile's last reads (its codes' stores) are done
    if (next < chunk_end) copy_operand(operand, p, row0, next, pairs, tile);
  };
  const bool columns = p.d_gate_columns != nullptr;
  fp8_register_block::Block block;
  // Each tile's block, its forms (the column codes through the tile's own memory:
  // write_column_groups' first barrier follows every thread's read of its block), then the
  // next chunk's operand into it.
  auto quantize = [&](StagedTile& tile, void* rows_out, float* row_scales, void* columns_out,
                      float* column_scales, const uint4* operand) {
    fp8_register_block::load_staged_block(tile, block);
    if (rows_out != nullptr)
      fp8_register_block::write_row_groups(block, tile_row, chunk, p.capacity_rows, inter,
                                           static_cast<uint8_t*>(rows_out), row_scales);
    if (columns)
      fp8_register_block::write_column_groups(
          block, tile_row, chunk, p.capacity_rows, inter, static_cast<uint8_t*>(columns_out),
          column_scales, tiles.column_scratch,
          *reinterpret_cast<fp8_register_block::CodeTile*>(&tile));
    copy_next(operand, tile);
  };
  quantize(tiles.d_gate, p.d_gate_rows, p.d_gate_row_scales, p.d_gate_columns,
           p.d_gate_column_scales, args.gate);
  quantize(tiles.d_up, p.d_up_rows, p.d_up_row_scales, p.d_up_columns, p.d_up_column_scales,
           args.up);
  if (columns) {
    quantize(tiles.h_w, nullptr, nullptr, p.h_w_columns, p.h_w_column_scales, args.dh_raw);
  } else if (next < chunk_end) {
    copy_operand(args.dh_raw, p, row0, next, pairs, tiles.h_w);
  }
}

// kGroupPartials: the CTA takes a run of the groups and leaves their router sums in
// p.router_grad_partials.
template <bool kGroupPartials>
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    swiglu_backward_quantize_kernel(Fp8SwigluBackward p) {
  ptx::begin_after_previous_kernel();
  extern __shared__ __align__(16) uint8_t shared[];
  SwigluBackwardTiles& tiles = *reinterpret_cast<SwigluBackwardTiles*>(shared);
  __shared__ int32_t tile_pairs[kTile];  // shared, not per thread: registers are what bind here
  __shared__ float tile_weights[kTile];
  const SwigluBackwardArgs& args = p.swiglu;
  const int64_t total_rows = p.header->total_rows;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kTile;
  if (row0 >= total_rows) return;
  if (threadIdx.x < kTile) {
    const int64_t row = row0 + threadIdx.x;
    const int32_t pair = row >= total_rows          ? kPastTheRows
                         : args.row_pair != nullptr ? args.row_pair[row]
                                                    : static_cast<int32_t>(row);
    tile_pairs[threadIdx.x] = pair;
    tile_weights[threadIdx.x] = pair >= 0 ? swiglu_row_weight(args, pair) : 0.0f;
  }
  __syncthreads();
  const int slot = threadIdx.x % kSlots, first = threadIdx.x / kSlots;
  float dots[kRowsPerThread][2];
#pragma unroll
  for (int k = 0; k < kRowsPerThread; ++k) dots[k][0] = dots[k][1] = 0.0f;
  // This CTA's run of the 256-column groups (blockIdx.y of gridDim.y), as chunks.
  const int64_t chunks = args.vectors_per_row / kSlots, groups = (chunks + 1) / 2;
  const int64_t per_run = (groups + gridDim.y - 1) / gridDim.y;
  const int64_t chunk_begin = 2 * per_run * blockIdx.y;
  const int64_t chunk_end = min(chunks, chunk_begin + 2 * per_run);
  if (chunk_begin < chunk_end) {
    copy_operand(args.gate, p, row0, chunk_begin, tile_pairs, tiles.d_gate);
    copy_operand(args.up, p, row0, chunk_begin, tile_pairs, tiles.d_up);
    copy_operand(args.dh_raw, p, row0, chunk_begin, tile_pairs, tiles.h_w);
  }
  for (int64_t chunk = chunk_begin; chunk < chunk_end; ++chunk)
    swiglu_backward_chunk<kGroupPartials>(p, row0, chunk, chunk_end, tile_pairs, tile_weights, dots,
                                          tiles);
  if (args.d_router_weights == nullptr && args.d_router_weights_peers == nullptr) return;
  // An odd number of chunks leaves the last group's odd half past the row's end: +0.
  if constexpr (kGroupPartials) {
    if (chunks % 2 != 0 && chunk_end == chunks && chunk_begin < chunk_end) {
#pragma unroll
      for (int k = 0; k < kRowsPerThread; ++k)
        store_group_partial(p.router_grad_partials, p.capacity_rows, row0, first + kRowStride * k,
                            groups - 1, tile_pairs, dots[k][1] + 0.0f);
    }
  } else {  // launch_router_weight_grad_sum stores (and fences) the partials' sums
#pragma unroll
    for (int k = 0; k < kRowsPerThread; ++k) {
      const float dot = chunks % 2 != 0 ? dots[k][0] + (dots[k][1] + 0.0f) : dots[k][0];
      const int32_t pair = tile_pairs[first + kRowStride * k];
      if (slot == 0 && pair >= 0) store_router_weight_grad(args, pair, dot);
    }
    // Expert parallel: the gradients went to other GPUs; visible at system scope before the
    // push kernel's signal, as the standalone pass does.
    if (args.d_router_weights_peers != nullptr) __threadfence_system();
  }
}

}  // namespace

cudaError_t launch_swiglu_backward_quantize_fp8(const Fp8SwigluBackward& p, KernelStream on) {
  const int64_t inter = p.swiglu.vectors_per_row * 8;
  const bool columns = p.d_gate_columns != nullptr;
  if (p.header == nullptr || inter <= 0 || inter % kTile != 0 || p.capacity_rows < 0 ||
      p.capacity_rows % kTile != 0 || p.swiglu.row_begin != 0 || p.d_gate_rows == nullptr ||
      p.d_gate_row_scales == nullptr || p.d_up_rows == nullptr || p.d_up_row_scales == nullptr ||
      (p.d_gate_column_scales != nullptr) != columns || (p.d_up_columns != nullptr) != columns ||
      (p.d_up_column_scales != nullptr) != columns || (p.h_w_columns != nullptr) != columns ||
      (p.h_w_column_scales != nullptr) != columns)
    return cudaErrorInvalidValue;
  if (p.column_splits < 0) return cudaErrorInvalidValue;
  if (p.capacity_rows == 0) return cudaSuccess;
  // How many CTAs take each row tile's I: split only where each group's router sum can wait in
  // the partials (or no router gradient is wanted).
  const int64_t row_tiles = p.capacity_rows / kTile;
  const int32_t groups = static_cast<int32_t>((inter / kTile + 1) / 2);
  const bool router_grads =
      p.swiglu.d_router_weights != nullptr || p.swiglu.d_router_weights_peers != nullptr;
  int32_t splits = 1;
  if (!router_grads || (p.router_grad_partials != nullptr && p.swiglu.row_pair != nullptr)) {
    if (p.column_splits > 0) {
      splits = p.column_splits < groups ? p.column_splits : groups;
    } else {
      splits = swiglu_backward_quantize_splits(
          row_tiles, groups, static_cast<int64_t>(kCtasPerSm) * current_sm_count());
    }
  }
  Fp8SwigluBackward run = p;
  if (!router_grads || splits == 1) run.router_grad_partials = nullptr;
  auto* kernel = run.router_grad_partials != nullptr ? swiglu_backward_quantize_kernel<true>
                                                     : swiglu_backward_quantize_kernel<false>;
  constexpr int kSharedBytes = sizeof(SwigluBackwardTiles);
  cudaError_t status =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSharedBytes);
  if (status != cudaSuccess) return status;
  status = launch_maybe_overlapped(
      kernel, dim3(static_cast<unsigned>(row_tiles), static_cast<unsigned>(splits)), kThreads,
      kSharedBytes, on, 1, run);
  if (status != cudaSuccess || run.router_grad_partials == nullptr) return status;
  return launch_router_weight_grad_sum(
      p.header, run.router_grad_partials, p.capacity_rows, p.swiglu.row_pair, inter,
      p.swiglu.d_router_weights, p.swiglu.d_router_weights_peers, p.swiglu.pairs_per_rank, on);
}

}  // namespace mok::kernels
