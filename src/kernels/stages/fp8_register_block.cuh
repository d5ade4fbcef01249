// The FP8 group quantizers from register blocks, shared by the quantization passes
// (fp8_quantize.cu's row and column groups, the gathered rows' pass fp8_gather_quantize.cu) and
// the FP8 backward's SwiGLU pass (swiglu_backward_quantize.cu):
// a 256-thread CTA holds a 128 x 128 bf16 tile as one 8 x 8 block a thread, rows
// 8 (t / 16) + k and columns 8 (t % 16) + j (k, j = 0..7; block[k] is row k's eight values), so
// a half-warp holds eight whole rows. From there:
//   - row groups (write_row_groups): each row's maximum over its half-warp by a butterfly on
//     packed bf16 pairs (HMNMX2 .abs .NaN; two rows a word), lane i < 8 of the half-warp makes
//     row i's factors and hands the inverses round by shuffle, and each thread writes 8 bytes a
//     row (a half-warp store: one whole 128-byte line);
//   - column groups (write_column_groups): each column pair's maximum over the thread's rows,
//     the warp's two halves by one shuffle, the eight warps through shared memory, where thread
//     c < 128 makes column c's factors; the codes go into a 16 KB code tile of the transposed
//     block whose 16-byte units are swizzled by column block (one row block's stores from the
//     16 column blocks fall on distinct banks), then out as whole 128-byte lines.
// Each value is widened to fp32 once per form it is written in. The maxima are exact (max and
// abs of bf16 values), so the factors and each code (the value times a power of two, then the
// hardware's cvt.rn.satfinite.e4m3x2.f32) are those of mok/fp8.h's host quantizers; NaN maxima
// come out canonical, as the float maxima's. The layouts written are fp8_quantize.h's kRowGroups
// and kColumnGroups.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/common/ptx.cuh"
#include "kernels/stages/fp8_group_tile.cuh"
#include "mok/fp8.h"

namespace mok::kernels::fp8_register_block {

using fp8_tile::kThreads;
using fp8_tile::kTile;

constexpr int kBlock = 8;                       // a thread's block: kBlock rows x kBlock columns
constexpr int kBlocksPerLine = kTile / kBlock;  // 16 column blocks (and row blocks) a tile
constexpr int kWarps = kThreads / 32;
constexpr int kUnitsPerLine = kTile / 16;  // 16-byte units of a 128-byte line of codes
static_assert(kBlocksPerLine * kBlocksPerLine == kThreads, "one block a thread");

using Block = uint4[kBlock];

// Line c: column c's 128 codes, its 16-byte units swizzled (swizzled_unit).
using CodeTile = uint8_t[kTile][kTile];

// What the column groups pass between the CTA's threads.
struct ColumnScratch {
  uint4 column_pair_max[kWarps][kBlocksPerLine];  // a warp's column-pair maxima, bf16x2 words
  float column_inverse[kTile];
};

// A CTA's shared memory for write_column_groups, where nothing else lends it a code tile.
struct ColumnGroupsShared {
  CodeTile codes;
  ColumnScratch scratch;
};

__device__ __forceinline__ int block_row() { return threadIdx.x / kBlocksPerLine; }
__device__ __forceinline__ int block_column() { return threadIdx.x % kBlocksPerLine; }

// The thread's block of a tile staged in shared memory (each 16-byte load: a quarter-warp reads
// eight units of one row, no bank conflict).
__device__ __forceinline__ void load_staged_block(const fp8_tile::StagedTile& tile, Block& block) {
#pragma unroll
  for (int k = 0; k < kBlock; ++k)
    block[k] =
        *reinterpret_cast<const uint4*>(&tile[block_row() * kBlock + k][block_column() * kBlock]);
}

// The unit of line `line` of the code tile that holds its 16-byte unit `unit`: swizzled by
// column block, so that the 16 column blocks' stores of one row block spread over the banks.
__device__ __forceinline__ int swizzled_unit(int line, int unit) {
  return unit ^ ((line / kBlock) % kUnitsPerLine);
}

// Two bf16x2 words' maxima (the larger magnitude of each word's halves), packed: `a`'s in the
// low half, `b`'s in the high.
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

__device__ __forceinline__ uint32_t word_of(const uint4& v, int w) {
  return w == 0 ? v.x : w == 1 ? v.y : w == 2 ? v.z : v.w;
}

// Row groups of tile (tile_row, tile_col) of a [rows, cols] matrix from the CTA's blocks: codes
// into out [rows, cols], scales into [cols/128, rows]. No shared memory, no barrier.
__device__ __forceinline__ void write_row_groups(const Block& block, int64_t tile_row,
                                                 int64_t tile_col, int64_t rows, int64_t cols,
                                                 uint8_t* out, float* scales) {
  uint32_t maxima[kBlock / 2];  // rows 2m and 2m + 1 of the block, low half first
#pragma unroll
  for (int m = 0; m < kBlock / 2; ++m) {
    uint32_t pair[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4& v = block[2 * m + h];
      pair[h] = ptx::max_abs_bf16x2_nan(ptx::max_abs_bf16x2_nan(v.x, v.y),
                                        ptx::max_abs_bf16x2_nan(v.z, v.w));
    }
    maxima[m] = pack_two_maxima(pair[0], pair[1]);
  }
#pragma unroll
  for (int offset = 1; offset < kBlocksPerLine; offset *= 2)
#pragma unroll
    for (int m = 0; m < kBlock / 2; ++m)
      maxima[m] =
          ptx::max_abs_bf16x2_nan(maxima[m], __shfl_xor_sync(0xffffffffu, maxima[m], offset));
  // Lane i < 8 of the half-warp: row i of the block (lanes 8-15 repeat lanes 0-7).
  const int own = block_column() % kBlock;
  uint32_t own_word = maxima[0];
#pragma unroll
  for (int m = 1; m < kBlock / 2; ++m)
    if (own / 2 == m) own_word = maxima[m];
  const Fp8GroupScale factors = fp8_group_scale(amax_of_half(own_word, own % 2 != 0));
  const int64_t row0 = tile_row * kTile + block_row() * kBlock;
  if (block_column() < kBlock) scales[tile_col * rows + row0 + own] = factors.scale;
  uint8_t* codes = out + row0 * cols + tile_col * kTile + block_column() * kBlock;
  const int half_warp = (threadIdx.x % 32) & kBlocksPerLine;
#pragma unroll
  for (int k = 0; k < kBlock; ++k) {
    const float inverse = __shfl_sync(0xffffffffu, factors.inverse_scale, half_warp | k);
    *reinterpret_cast<uint2*>(codes + k * cols) = fp8_tile::codes8(block[k], inverse);
  }
}

// Column groups of tile (tile_row, tile_col) of a [rows, cols] matrix from the CTA's blocks:
// codes into out [cols, rows] (the transpose), scales into [rows/128, cols]. Every thread of
// the CTA calls it (three barriers). `codes` may be the memory the blocks were loaded from:
// the first barrier follows every thread's last use of its block's source. The caller puts a
// barrier between this call's code tile reads (the last stores) and its next writes to it.
__device__ __forceinline__ void write_column_groups(const Block& block, int64_t tile_row,
                                                    int64_t tile_col, int64_t rows, int64_t cols,
                                                    uint8_t* out, float* scales,
                                                    ColumnScratch& scratch, CodeTile& codes) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
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
    scratch.column_pair_max[warp][block_column()] =
        make_uint4(pair_max[0], pair_max[1], pair_max[2], pair_max[3]);
  __syncthreads();
  if (threadIdx.x < kTile) {
    const int column = threadIdx.x;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(scratch.column_pair_max);
    constexpr int kWordsPerWarp = kBlocksPerLine * 4;
    uint32_t running = words[column / 2];
#pragma unroll
    for (int w = 1; w < kWarps; ++w)
      running = ptx::max_abs_bf16x2_nan(running, words[w * kWordsPerWarp + column / 2]);
    const Fp8GroupScale factors = fp8_group_scale(amax_of_half(running, column % 2 != 0));
    scales[tile_row * cols + tile_col * kTile + column] = factors.scale;
    scratch.column_inverse[column] = factors.inverse_scale;
  }
  __syncthreads();
  float inverse[kBlock];
  const float* own_inverses = &scratch.column_inverse[block_column() * kBlock];
  *reinterpret_cast<float4*>(&inverse[0]) = *reinterpret_cast<const float4*>(own_inverses);
  *reinterpret_cast<float4*>(&inverse[4]) = *reinterpret_cast<const float4*>(own_inverses + 4);
  // Column j's eight rows: half (j % 2) of word j / 2 of each row's vector.
  const int unit = block_row() / 2, unit_half = block_row() % 2;
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    float values[kBlock];
#pragma unroll
    for (int k = 0; k < kBlock; ++k) {
      const uint32_t word = word_of(block[k], j / 2);
      values[k] = j % 2 ? fp8_tile::high_bf16(word) : fp8_tile::low_bf16(word);
    }
    const float s = inverse[j];
    const uint2 eight = make_uint2(fp8_tile::codes4(values[0], values[1], values[2], values[3], s),
                                   fp8_tile::codes4(values[4], values[5], values[6], values[7], s));
    const int line = block_column() * kBlock + j;
    *reinterpret_cast<uint2*>(&codes[line][swizzled_unit(line, unit) * 16 + unit_half * 8]) = eight;
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kTile * kUnitsPerLine / kThreads; ++i) {
    const int v = threadIdx.x + i * kThreads, line = v / kUnitsPerLine, u = v % kUnitsPerLine;
    *reinterpret_cast<uint4*>(out + (tile_col * kTile + line) * rows + tile_row * kTile + u * 16) =
        *reinterpret_cast<const uint4*>(&codes[line][swizzled_unit(line, u) * 16]);
  }
}

}  // namespace mok::kernels::fp8_register_block
