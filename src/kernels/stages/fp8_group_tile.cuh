// The FP8 group quantizers' tile stage of the quantization passes (fp8_quantize.cu): one 128 x
// 128 bf16 tile staged in shared memory by a 256-thread CTA, then quantized in row groups (each
// thread half a row) or column groups (each thread half a column, the codes written transposed
// through the tile's own memory). Bit-exact with mok/fp8.h's host quantizers. Its tile type and
// the code helpers (to_e4m3x2, codes4, the bf16 halves) serve the register-block quantizers
// (fp8_register_block.cuh) and the FP8 backward's SwiGLU pass, which stages its tiles in this
// layout, too.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "kernels/common/ptx.cuh"
#include "mok/fp8.h"

namespace mok::kernels::fp8_tile {

constexpr int kTile = 128;
constexpr int kThreads = 256;      // the CTA every helper below assumes
constexpr int kPitch = kTile + 8;  // bf16 per staged row: 16-byte aligned rows, fewer conflicts

// Two values -> their e4m3 codes in the low and the high byte.
__device__ __forceinline__ uint16_t to_e4m3x2(float low, float high) {
  return static_cast<uint16_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(low, high), __NV_SATFINITE, __NV_E4M3));
}

using StagedTile = __nv_bfloat16[kTile][kPitch];
// 128 lines of codes; the pitch keeps them 16-byte aligned, and a quarter-warp's 16-byte stores
// (two halves of each of four lines) on distinct banks.
constexpr int kCodePitch = kTile + 16;
using CodeTile = uint8_t[kTile][kCodePitch];

// Thread (line, half)'s 64 values of a staged tile: half of row `line`, or of column `line`.
template <bool kAlongColumns>
__device__ __forceinline__ void load_line(const StagedTile& tile, int line, int half,
                                          float (&values)[64]) {
  for (int i = 0; i < 64; ++i) {
    const int along = half * 64 + i;
    values[i] = __bfloat162float(kAlongColumns ? tile[along][line] : tile[line][along]);
  }
}

// The largest magnitude of the line the thread pair (lanes 2j, 2j + 1) holds, NaN if any.
__device__ __forceinline__ float line_amax(const float (&values)[64]) {
  float amax = 0.0f;
  for (int i = 0; i < 64; ++i) amax = ptx::max_nan(amax, fabsf(values[i]));
  return ptx::max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
}

// Four values' codes as one word, the first value in the low byte.
__device__ __forceinline__ uint32_t codes4(float v0, float v1, float v2, float v3, float inverse) {
  return uint32_t(to_e4m3x2(v0 * inverse, v1 * inverse)) |
         (uint32_t(to_e4m3x2(v2 * inverse, v3 * inverse)) << 16);
}

// The 64 values' codes as four 16-byte stores at `destination`.
__device__ __forceinline__ void store_codes(const float (&values)[64], const Fp8GroupScale& factors,
                                            uint4* destination) {
  for (int chunk = 0; chunk < 4; ++chunk) {
    uint32_t words[4];
    for (int w = 0; w < 4; ++w) {
      const int i = chunk * 16 + w * 4;
      words[w] =
          codes4(values[i], values[i + 1], values[i + 2], values[i + 3], factors.inverse_scale);
    }
    destination[chunk] = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// A bf16 pair's two values (low half first).
__device__ __forceinline__ float low_bf16(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float high_bf16(uint32_t pair) {
  return __uint_as_float(pair & 0xffff0000u);
}

// Eight bf16 values (one uint4) times `inverse` as eight e4m3 codes, the first in the low byte.
__device__ __forceinline__ uint2 codes8(const uint4& v, float inverse) {
  return make_uint2(codes4(low_bf16(v.x), high_bf16(v.x), low_bf16(v.y), high_bf16(v.y), inverse),
                    codes4(low_bf16(v.z), high_bf16(v.z), low_bf16(v.w), high_bf16(v.w), inverse));
}

// The larger magnitude of a max_abs_bf16x2_nan result's two halves, as a float (NaN if either
// is: canonical, as the float maxima's).
__device__ __forceinline__ float halves_amax(uint32_t pair) {
  return ptx::max_nan(fabsf(low_bf16(pair)), fabsf(high_bf16(pair)));
}

// The largest magnitude (NaN if any is NaN) of eight vectors of eight bf16 values, bf16x2: one
// thread's loaded run, to reduce with halves_amax.
__device__ __forceinline__ uint32_t max_abs_of(const uint4 (&values)[8]) {
  uint32_t running = 0;
#pragma unroll
  for (int v = 0; v < 8; ++v)
    running = ptx::max_abs_bf16x2_nan(
        running, ptx::max_abs_bf16x2_nan(ptx::max_abs_bf16x2_nan(values[v].x, values[v].y),
                                         ptx::max_abs_bf16x2_nan(values[v].z, values[v].w)));
  return running;
}

// kRowGroups of one staged tile (tile row `tile_row`, column `tile_col` of a [rows, cols]
// matrix) into out [rows, cols] and scales [cols/128, rows]. Lane l of warp w holds half l / 16
// of row 16 w + l % 16, as four runs of 16 columns (32 c + 16 half ..): a shared-memory phase's
// eight lanes read eight rows at eight 16-byte bank offsets (the 272-byte pitch), and the two
// lanes of a row write one whole 32-byte sector per store.
__device__ __forceinline__ void quantize_row_groups(const StagedTile& tile, int64_t tile_row,
                                                    int64_t tile_col, int64_t rows, int64_t cols,
                                                    uint8_t* out, float* scales) {
  const int lane = threadIdx.x % 32;
  const int line = (threadIdx.x / 32) * 16 + lane % 16, half = lane / 16;
  uint4 pairs[8];  // run c's 16 values in pairs[2c], pairs[2c + 1]
#pragma unroll
  for (int v = 0; v < 8; ++v)
    pairs[v] = *reinterpret_cast<const uint4*>(&tile[line][(v / 2) * 32 + half * 16 + (v % 2) * 8]);
  float amax = halves_amax(max_abs_of(pairs));
  amax = ptx::max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 16));
  const Fp8GroupScale factors = fp8_group_scale(amax);
  const float inverse = factors.inverse_scale;
  uint8_t* destination = out + (tile_row * kTile + line) * cols + tile_col * kTile + half * 16;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint4& source = pairs[2 * c + w / 2];
      const uint32_t first = w % 2 ? source.z : source.x, second = w % 2 ? source.w : source.y;
      words[w] =
          codes4(low_bf16(first), high_bf16(first), low_bf16(second), high_bf16(second), inverse);
    }
    *reinterpret_cast<uint4*>(destination + c * 32) =
        make_uint4(words[0], words[1], words[2], words[3]);
  }
  if (half == 0) scales[tile_col * rows + tile_row * kTile + line] = factors.scale;
}

// kColumnGroups of one staged tile (tile row `tile_row`, column `tile_col` of a [rows, cols]
// matrix) into out [cols, rows] (the transpose) and scales [rows/128, cols]: each thread holds
// half a column (the blocks' transposed layout's lines). The codes go back through the tile's
// own shared memory, which the values have left for registers, so that every 16-byte global
// store belongs to a whole 128-byte line that eight threads write together; stored straight
// from the threads, each store instruction wrote 16 bytes into each of 16 lines. The last use
// of the tile: the caller reads it no more. (A layout of two columns of 32 rows per thread,
// with the quarters' maxima through shared memory, measured slower: docs/perf.md, session 29.)
__device__ __forceinline__ void quantize_column_groups(StagedTile& tile, int64_t tile_row,
                                                       int64_t tile_col, int64_t rows, int64_t cols,
                                                       uint8_t* out, float* scales) {
  const int line = threadIdx.x / 2, half = threadIdx.x % 2;
  float values[64];
  load_line<true>(tile, line, half, values);
  const Fp8GroupScale factors = fp8_group_scale(line_amax(values));
  const int64_t out_row0 = tile_col * kTile;
  if (half == 0) scales[tile_row * cols + out_row0 + line] = factors.scale;
  static_assert(sizeof(CodeTile) <= sizeof(StagedTile), "the codes fit in the staged tile");
  CodeTile& codes = *reinterpret_cast<CodeTile*>(&tile);
  __syncthreads();  // every thread holds its values: the tile's memory takes the codes
  store_codes(values, factors, reinterpret_cast<uint4*>(&codes[line][half * 64]));
  __syncthreads();
  for (int v = threadIdx.x; v < kTile * (kTile / 16); v += kThreads) {
    const int r = v / (kTile / 16), c = (v % (kTile / 16)) * 16;
    *reinterpret_cast<uint4*>(out + (out_row0 + r) * rows + tile_row * kTile + c) =
        *reinterpret_cast<const uint4*>(&codes[r][c]);
  }
}

}  // namespace mok::kernels::fp8_tile
