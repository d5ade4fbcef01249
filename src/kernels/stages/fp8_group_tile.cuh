// The FP8 group quantizers' shared pieces: the 128 x 128 tile and its 256-thread CTA, the bf16
// tile staged in shared memory (the FP8 backward's SwiGLU pass stages its operands in this
// layout), the code tile of the weights' blocks and the transposes, and the code helpers
// (to_e4m3x2, codes4, codes8, the bf16 halves and maxima) that every quantizer writes its codes
// with: fp8_quantize.cu, and the register-block quantizers (fp8_register_block.cuh) of the
// row and column groups. Bit-exact with mok/fp8.h's host quantizers.
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
// 128 lines of codes (the weights' blocks transposed, fp8_quantize.cu); the pitch keeps the lines
// 16-byte aligned and moves each line's bank by four words.
constexpr int kCodePitch = kTile + 16;
using CodeTile = uint8_t[kTile][kCodePitch];

// Four values' codes as one word, the first value in the low byte.
__device__ __forceinline__ uint32_t codes4(float v0, float v1, float v2, float v3, float inverse) {
  return uint32_t(to_e4m3x2(v0 * inverse, v1 * inverse)) |
         (uint32_t(to_e4m3x2(v2 * inverse, v3 * inverse)) << 16);
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

}  // namespace mok::kernels::fp8_tile
