// SwiGLU and the FP8 quantization of h in one memory-bound pass (swiglu_quantize.h).
//
// Grid: 256-thread CTAs; each half-warp owns one 1 x 128 group of one row: every lane loads 8
// gate and 8 up values (16 bytes each), computes their h with the epilogue's code
// (swiglu_forward_unit), the group's amax comes from four shuffles (NaN-propagating, as the
// quantizers'), and each lane writes its 8 codes (8 bytes); lane 0 of the half-warp writes the
// group's scale.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "kernels/common/overlapped_launch.h"
#include "kernels/common/ptx.cuh"
#include "kernels/stages/swiglu.cuh"
#include "kernels/stages/swiglu_quantize.h"
#include "mok/fp8.h"

namespace mok::kernels {

namespace {

constexpr int kThreads = 256;
constexpr int kLanesPerGroup = 16;  // 8 values each

__global__ void __launch_bounds__(kThreads)
    swiglu_quantize_kernel(const uint4* gate, const uint4* up, int64_t rows, int64_t inter,
                           float limit, uint2* h_codes, float* h_scales) {
  ptx::begin_after_previous_kernel();
  const int64_t groups_per_row = inter / 128;
  const int64_t group = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) /
                        kLanesPerGroup;  // row-major over (row, group)
  const int lane = threadIdx.x % kLanesPerGroup;
  if (group >= rows * groups_per_row) return;  // whole half-warps leave together
  const int64_t row = group / groups_per_row, group_in_row = group % groups_per_row;
  const int64_t unit = row * (inter / 8) + group_in_row * kLanesPerGroup + lane;
  const uint4 g = gate[unit], u = up[unit];
  const uint4 h = swiglu_forward_unit(g, u, limit);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&h);
  float values[8];
  float amax = 0.0f;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const float2 v = __bfloat1622float2(pairs[p]);
    values[2 * p] = v.x;
    values[2 * p + 1] = v.y;
    amax = ptx::max_nan(amax, ptx::max_nan(fabsf(v.x), fabsf(v.y)));
  }
  const unsigned half_mask = (threadIdx.x % 32) < 16 ? 0x0000ffffu : 0xffff0000u;
  for (int offset = 1; offset < kLanesPerGroup; offset *= 2)
    amax = ptx::max_nan(amax, __shfl_xor_sync(half_mask, amax, offset));
  const Fp8GroupScale factors = fp8_group_scale(amax);
  uint32_t words[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    const float* v = values + 4 * w;
    const uint32_t low = __nv_cvt_float2_to_fp8x2(
        make_float2(v[0] * factors.inverse_scale, v[1] * factors.inverse_scale), __NV_SATFINITE,
        __NV_E4M3);
    const uint32_t high = __nv_cvt_float2_to_fp8x2(
        make_float2(v[2] * factors.inverse_scale, v[3] * factors.inverse_scale), __NV_SATFINITE,
        __NV_E4M3);
    words[w] = low | (high << 16);
  }
  h_codes[unit] = make_uint2(words[0], words[1]);
  if (lane == 0) h_scales[group_in_row * rows + row] = factors.scale;
}

}  // namespace

cudaError_t launch_swiglu_quantize_fp8(const void* gate, const void* up, int64_t rows,
                                       int64_t inter, float limit, void* h_codes, float* h_scales,
                                       KernelStream on) {
  if (rows < 0 || inter <= 0 || inter % 128 != 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const int64_t threads = rows * (inter / 128) * kLanesPerGroup;
  const int64_t blocks = (threads + kThreads - 1) / kThreads;
  return launch_maybe_overlapped(swiglu_quantize_kernel, static_cast<unsigned>(blocks), kThreads, 0,
                                 on, 1, static_cast<const uint4*>(gate),
                                 static_cast<const uint4*>(up), rows, inter, limit,
                                 static_cast<uint2*>(h_codes), h_scales);
}

}  // namespace mok::kernels
