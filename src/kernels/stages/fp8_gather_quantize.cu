// The local exchange's FP8 rows gathered and quantized in one pass (launch_gather_quantize_fp8,
// fp8_quantize.h): the bits the quantizers of fp8_quantize.cu give for the gathered bf16 rows,
// with no bf16 copy staged anywhere.
//
// Grid: one 256-thread CTA per 128 x 128 tile, row tiles fastest (x), column tiles (y). Thread
// t holds an 8 x 8 block of the tile in registers: rows 8 (t / 16) + k and columns 8 (t % 16)
// + j, k, j = 0..7, as eight 16-byte loads (one a row). A half-warp holds eight whole rows, so a
// warp's load instruction reads two whole 256-byte row slices. The pass:
//   1. the tile's 128 token indices into shared memory (from the schedule's row_pair);
//   2. the eight row loads, all in flight together (zeros for padding rows);
//   3. maxima on the packed bf16 pairs (HMNMX2 .abs .NaN, no conversion): each row's over the
//      half-warp by a butterfly of four words (two rows a word), each column pair's over the
//      thread's rows, the warp's two halves by one shuffle and the eight warps through shared
//      memory, where thread c < 128 finishes column c;
//   4. the factors (fp8_group_scale): lane i < 8 of a half-warp computes row i's and hands the
//      inverses round by shuffle; thread c < 128 column c's, its inverse through shared memory;
//   5. the row codes, 8 bytes a row from each thread (a half-warp store: one whole 128-byte
//      line), and the column codes into a 16 KB code tile of the transposed block whose 16-byte
//      units are swizzled by column block, so that one row block's 8-byte stores from the 16
//      column blocks fall on distinct banks; the tile then leaves as whole 128-byte lines.
// Each value is widened to fp32 once per form it is written in. The maxima are exact (max and
// abs of bf16 values), so the factors, and each code (the value times a power of two, then the
// hardware's cvt.rn.satfinite.e4m3x2.f32), are those of the staged quantizers
// (fp8_group_tile.cuh); NaN maxima come out canonical, as the float maxima's.
#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/common/overlapped_launch.h"
#include "kernels/common/ptx.cuh"
#include "kernels/stages/fp8_group_tile.cuh"
#include "kernels/stages/fp8_quantize.h"
#include "mok/fp8.h"

namespace mok::kernels {

namespace {

using fp8_tile::kThreads;
using fp8_tile::kTile;

constexpr int kBlock = 8;                       // a thread's block: kBlock rows x kBlock columns
constexpr int kBlocksPerLine = kTile / kBlock;  // 16 column blocks (and row blocks) a tile
constexpr int kWarps = kThreads / 32;
constexpr int kUnitsPerLine = kTile / 16;  // 16-byte units of a 128-byte line of codes
static_assert(kBlocksPerLine * kBlocksPerLine == kThreads, "one block a thread");

// The shared memory of a tile.
struct GatherTileShared {
  uint8_t column_codes[kTile][kTile];  // line c: column c's 128 codes, units swizzled (below)
  uint4 column_pair_max[kWarps][kBlocksPerLine];  // a warp's column-pair maxima, bf16x2 words
  float column_inverse[kTile];
  int64_t tile_tokens[kTile];
};

// The unit of line `line` of the code tile that holds its 16-byte unit `unit`: swizzled by
// column block, so that the 16 column blocks' stores of one row block spread over the banks.
__device__ __forceinline__ int swizzled_unit(int line, int unit) {
  return unit ^ ((line / kBlock) % kUnitsPerLine);
}

// Both halves of a bf16x2 word as the larger magnitude of the two (the halves' max), then
// pair-packed: the low half of `a`'s and of `b`'s maxima in one word.
__device__ __forceinline__ uint32_t pack_two_maxima(uint32_t a, uint32_t b) {
  a = ptx::max_abs_bf16x2_nan(a, __byte_perm(a, 0, 0x1032));
  b = ptx::max_abs_bf16x2_nan(b, __byte_perm(b, 0, 0x1032));
  return __byte_perm(a, b, 0x5410);
}

// The magnitude in bf16 half `high` of a maximum word as a float: NaN made canonical (max.NaN).
__device__ __forceinline__ float amax_of_half(uint32_t word, bool high) {
  const float value = high ? fp8_tile::high_bf16(word) : fp8_tile::low_bf16(word);
  return ptx::max_nan(fabsf(value), 0.0f);
}

// Eight bf16 values (one uint4) times `inverse` as eight e4m3 codes, the first in the low byte.
__device__ __forceinline__ uint2 codes8(const uint4& v, float inverse) {
  using fp8_tile::codes4;
  using fp8_tile::high_bf16;
  using fp8_tile::low_bf16;
  return make_uint2(codes4(low_bf16(v.x), high_bf16(v.x), low_bf16(v.y), high_bf16(v.y), inverse),
                    codes4(low_bf16(v.z), high_bf16(v.z), low_bf16(v.w), high_bf16(v.w), inverse));
}

// Word `w` of a uint4.
__device__ __forceinline__ uint32_t word_of(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// Row groups of the thread's block: row maxima over the half-warp, the factors by lanes 0-7 of
// it (scales to global memory), then 8 bytes of codes a row.
__device__ __forceinline__ void write_row_groups(const Fp8GatherQuantize& p,
                                                 const uint4 (&block)[kBlock], int64_t tile_row,
                                                 int64_t tile_col) {
  const int lane = threadIdx.x % 32, row_block = threadIdx.x / kBlocksPerLine;
  const int column_block = threadIdx.x % kBlocksPerLine;
  uint32_t maxima[kBlock / 2];  // rows 2m and 2m + 1 of the block, low half first
#pragma unroll
  for (int m = 0; m < kBlock / 2; ++m) {
    uint32_t rows[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4& v = block[2 * m + h];
      rows[h] = ptx::max_abs_bf16x2_nan(ptx::max_abs_bf16x2_nan(v.x, v.y),
                                        ptx::max_abs_bf16x2_nan(v.z, v.w));
    }
    maxima[m] = pack_two_maxima(rows[0], rows[1]);
  }
#pragma unroll
  for (int offset = 1; offset < kBlocksPerLine; offset *= 2)
#pragma unroll
    for (int m = 0; m < kBlock / 2; ++m)
      maxima[m] =
          ptx::max_abs_bf16x2_nan(maxima[m], __shfl_xor_sync(0xffffffffu, maxima[m], offset));
  // Lane i < 8 of the half-warp: row i of the block.
  const int own = column_block % kBlock;
  uint32_t own_word = maxima[0];
#pragma unroll
  for (int m = 1; m < kBlock / 2; ++m)
    if (own / 2 == m) own_word = maxima[m];
  const Fp8GroupScale factors = fp8_group_scale(amax_of_half(own_word, own % 2 != 0));
  const int64_t row = tile_row * kTile + row_block * kBlock + own;
  if (column_block < kBlock) p.row_scales[tile_col * p.capacity_rows + row] = factors.scale;
  uint8_t* codes = static_cast<uint8_t*>(p.row_codes) +
                   (tile_row * kTile + row_block * kBlock) * p.cols + tile_col * kTile +
                   column_block * kBlock;
  const int half_warp = lane & kBlocksPerLine;
#pragma unroll
  for (int k = 0; k < kBlock; ++k) {
    const float inverse = __shfl_sync(0xffffffffu, factors.inverse_scale, half_warp | k);
    *reinterpret_cast<uint2*>(codes + k * p.cols) = codes8(block[k], inverse);
  }
}

// Column groups of the thread's block: column-pair maxima over the block's rows, the warp's
// two row blocks by a shuffle, the eight warps through shared memory; thread c < 128 takes
// column c's factors. The codes go to the code tile, then out as whole lines.
__device__ __forceinline__ void write_column_groups(const Fp8GatherQuantize& p,
                                                    const uint4 (&block)[kBlock], int64_t tile_row,
                                                    int64_t tile_col, GatherTileShared& shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int row_block = threadIdx.x / kBlocksPerLine, column_block = threadIdx.x % kBlocksPerLine;
  uint32_t pair_max[4];  // columns 2w, 2w + 1 of the block
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    uint32_t running = word_of(block[0], w);
#pragma unroll
    for (int k = 1; k < kBlock; ++k)
      running = ptx::max_abs_bf16x2_nan(running, word_of(block[k], w));
    pair_max[w] = ptx::max_abs_bf16x2_nan(running, __shfl_xor_sync(0xffffffffu, running, 16));
  }
  if (lane < kBlocksPerLine)
    shared.column_pair_max[warp][column_block] =
        make_uint4(pair_max[0], pair_max[1], pair_max[2], pair_max[3]);
  __syncthreads();
  if (threadIdx.x < kTile) {
    const int column = threadIdx.x;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(shared.column_pair_max);
    constexpr int kWordsPerWarp = kBlocksPerLine * 4;
    uint32_t running = words[column / 2];
#pragma unroll
    for (int w = 1; w < kWarps; ++w)
      running = ptx::max_abs_bf16x2_nan(running, words[w * kWordsPerWarp + column / 2]);
    const Fp8GroupScale factors = fp8_group_scale(amax_of_half(running, column % 2 != 0));
    p.column_scales[tile_row * p.cols + tile_col * kTile + column] = factors.scale;
    shared.column_inverse[column] = factors.inverse_scale;
  }
  __syncthreads();
  float inverse[kBlock];
  *reinterpret_cast<float4*>(&inverse[0]) =
      *reinterpret_cast<const float4*>(&shared.column_inverse[column_block * kBlock]);
  *reinterpret_cast<float4*>(&inverse[4]) =
      *reinterpret_cast<const float4*>(&shared.column_inverse[column_block * kBlock + 4]);
  // Column j's eight rows: half (j % 2) of word j / 2 of each row's vector.
  const int unit = row_block / 2, unit_half = row_block % 2;
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    float values[kBlock];
#pragma unroll
    for (int k = 0; k < kBlock; ++k) {
      const uint32_t word = word_of(block[k], j / 2);
      values[k] = j % 2 ? fp8_tile::high_bf16(word) : fp8_tile::low_bf16(word);
    }
    const float s = inverse[j];
    const uint2 codes = make_uint2(fp8_tile::codes4(values[0], values[1], values[2], values[3], s),
                                   fp8_tile::codes4(values[4], values[5], values[6], values[7], s));
    const int line = column_block * kBlock + j;
    *reinterpret_cast<uint2*>(
        &shared.column_codes[line][swizzled_unit(line, unit) * 16 + unit_half * 8]) = codes;
  }
  __syncthreads();
  uint8_t* out = static_cast<uint8_t*>(p.column_codes);
#pragma unroll
  for (int i = 0; i < kTile * kUnitsPerLine / kThreads; ++i) {
    const int v = threadIdx.x + i * kThreads, line = v / kUnitsPerLine, u = v % kUnitsPerLine;
    *reinterpret_cast<uint4*>(out + (tile_col * kTile + line) * p.capacity_rows + tile_row * kTile +
                              u * 16) =
        *reinterpret_cast<const uint4*>(&shared.column_codes[line][swizzled_unit(line, u) * 16]);
  }
}

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
  const int row_block = threadIdx.x / kBlocksPerLine;
  const int column = (threadIdx.x % kBlocksPerLine) * kBlock;
  const auto* tokens = static_cast<const __nv_bfloat16*>(p.tokens);
  uint4 block[kBlock];
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
  if (p.row_codes != nullptr) write_row_groups(p, block, tile_row, tile_col);
  if (p.column_codes != nullptr) write_column_groups(p, block, tile_row, tile_col, shared);
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
