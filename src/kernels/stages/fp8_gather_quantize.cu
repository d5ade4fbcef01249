// The local exchange's FP8 rows gathered and quantized in one pass (launch_gather_quantize_fp8,
// fp8_quantize.h): the bits the quantizers of fp8_quantize.cu give for the gathered bf16 rows,
// with no bf16 copy staged anywhere.
//
// Grid: one 256-thread CTA per 128 x 128 tile, row tiles fastest (x), column tiles (y). Thread
// t loads its 8 x 8 block of the tile (fp8_register_block.cuh: rows 8 (t / 16) + k, columns
// 8 (t % 16) + j) straight from the tokens' rows into registers, eight 16-byte loads in flight
// together (a warp's load instruction reads two whole 256-byte row slices), after the tile's
// 128 token indices went through shared memory. Then the row groups and the column groups are
// written from the blocks (fp8_register_block.cuh), the column codes through a 16 KB code tile.
#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/common/overlapped_launch.h"
#include "kernels/common/ptx.cuh"
#include "kernels/stages/fp8_quantize.h"
#include "kernels/stages/fp8_register_block.cuh"

namespace mok::kernels {

namespace {

using namespace fp8_register_block;  // the blocks and their group quantizers

struct GatherTileShared {
  ColumnGroupsShared column_groups;
  int64_t tile_tokens[kTile];
};

// A tile wholly past total_rows writes nothing; below it, every row of the tile is written
// (zeros for padding rows and rows past total_rows), except the bf16 copy, which stops at
// total_rows.
__global__ void __launch_bounds__(kThreads) gather_quantize_fp8_kernel(Fp8GatherQuantize p) {
  ptx::begin_after_previous_kernel();
  __shared__ __align__(16) GatherTileShared shared;
  const int64_t tile_row = blockIdx.x, tile_col = blockIdx.y;
  const int64_t row0 = tile_row * kTile, col0 = tile_col * kTile;
  const int64_t total_rows = p.header->total_rows;
  if (row0 >= total_rows) return;
  if (threadIdx.x < kTile) {
    const int64_t row = row0 + threadIdx.x;
    if (p.row_pair == nullptr) {  // the rows themselves
      shared.tile_tokens[threadIdx.x] = row < total_rows ? row : -1;
    } else {
      const int32_t pair = row < total_rows ? p.row_pair[row] : -1;
      shared.tile_tokens[threadIdx.x] = pair >= 0 ? pair / p.top_k : -1;
    }
  }
  __syncthreads();
  const int row_block = block_row(), column = block_column() * kBlock;
  const auto* tokens = static_cast<const __nv_bfloat16*>(p.tokens);
  Block block;
#pragma unroll
  for (int k = 0; k < kBlock; ++k) {
    const int64_t token = shared.tile_tokens[row_block * kBlock + k];
    block[k] = token >= 0
                   ? __ldg(reinterpret_cast<const uint4*>(tokens + token * p.cols + col0 + column))
                   : make_uint4(0, 0, 0, 0);
  }
  if (p.rows_bf16 != nullptr) {
#pragma unroll
    for (int k = 0; k < kBlock; ++k) {
      const int64_t row = row0 + row_block * kBlock + k;
      if (row < total_rows)
        *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.rows_bf16) + row * p.cols + col0 +
                                  column) = block[k];
    }
  }
  if (p.row_codes != nullptr)
    write_row_groups(block, tile_row, tile_col, p.capacity_rows, p.cols,
                     static_cast<uint8_t*>(p.row_codes), p.row_scales);
  if (p.column_codes != nullptr)
    write_column_groups(block, tile_row, tile_col, p.capacity_rows, p.cols,
                        static_cast<uint8_t*>(p.column_codes), p.column_scales,
                        shared.column_groups.scratch, shared.column_groups.codes);
}

}  // namespace

cudaError_t launch_gather_quantize_fp8(const Fp8GatherQuantize& params, KernelStream on) {
  if (params.cols <= 0 || params.cols % kTile != 0 || params.capacity_rows < 0 ||
      params.capacity_rows % kTile != 0 || params.header == nullptr ||
      (params.row_pair != nullptr && params.top_k <= 0) ||
      (params.row_codes != nullptr) != (params.row_scales != nullptr) ||
      (params.column_codes != nullptr) != (params.column_scales != nullptr))
    return cudaErrorInvalidValue;
  if (params.capacity_rows == 0) return cudaSuccess;
  // Row tiles fastest: the CTAs running together read one 128-column slice of every token row
  // (T x 256 bytes), which L2 keeps while each token's top_k copies are gathered. Column groups
  // fastest, they read whole token rows, and a token came back only some 36 row tiles later:
  // at dsv3_local (x 59 MB, beyond L2) the kernel read 414 MB for 59 (ncu, H100, session 44).
  const dim3 grid(static_cast<unsigned>(params.capacity_rows / kTile),
                  static_cast<unsigned>(params.cols / kTile));
  return launch_maybe_overlapped(gather_quantize_fp8_kernel, grid, kThreads, 0, on, 1, params);
}

}  // namespace mok::kernels
