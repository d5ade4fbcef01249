// SwiGLU and h's FP8 quantization in the gate/up GEMM's epilogue (Fp8GemmParams::swiglu_h_codes;
// fp8_gemm.cu's 128-row tiles and fp8_gemm_192_rows.cu's): the bits of swiglu_quantize.cu's pass,
// from the consumers' fragments instead of the stored g and u rows.
//
// A consumer thread holds two rows of its warpgroup's 64 x 128 tile (fragment_row(0) and (1)),
// and in each the columns 8 j + 2 q + c (j < 16, c < 2, q = lane % 4): the four threads of a
// quad hold one row's 128 columns, so a 1 x 128 group of h is one quad's. Per row: h pair by
// pair from the bf16 gate (staged by the unit's gate tile) and up values (swiglu.cuh's
// swiglu_forward_pair, as the pass), the group's amax from the thread's pairs and two quad
// shuffles (NaN-propagating, and a NaN canonical as the pass's float max makes it), the codes
// pair by pair, then a 4 x 4 exchange of 2-byte code pairs within the quad so that each thread
// writes four runs of 8 bytes (columns 8 j' .. 8 j' + 7 for j' = q, q + 4, ...): every store of a
// warp fills whole 32-byte sectors. Lane q = 0 writes the row's scale.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "kernels/common/ptx.cuh"
#include "kernels/gemm/fp8_gemm.h"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/stages/swiglu.cuh"
#include "mok/fp8.h"

namespace mok::kernels {

// A bf16 pair as its 32 bits and back, in registers (a reinterpret_cast of a local's address
// puts it in local memory).
__device__ __forceinline__ uint32_t bf16x2_bits(__nv_bfloat162 pair) {
  return static_cast<uint32_t>(__bfloat16_as_ushort(pair.x)) |
         (static_cast<uint32_t>(__bfloat16_as_ushort(pair.y)) << 16);
}
__device__ __forceinline__ __nv_bfloat162 bf16x2_of_bits(uint32_t bits) {
  return __halves2bfloat162(__ushort_as_bfloat16(static_cast<unsigned short>(bits & 0xffffu)),
                            __ushort_as_bfloat16(static_cast<unsigned short>(bits >> 16)));
}

// Of four 32-bit words, the one at index `k` (0-3, lane-dependent) without local memory.
__device__ __forceinline__ uint32_t fp8_pick_of_four(uint32_t w0, uint32_t w1, uint32_t w2,
                                                     uint32_t w3, int k) {
  const uint32_t low = (k & 1) ? w1 : w0, high = (k & 1) ? w3 : w2;
  return (k & 2) ? high : low;
}

// One fragment row of h: `gate(j)` and `up(j)` its 16 bf16 pairs as bits (pair j at columns
// 8 j + 2 q, + 1; accessors, so that the caller keeps them in registers of its own), into the
// row `codes_row` (the 128 codes of the group, a row of [R, I] e4m3) and `*scale`. Every lane of
// the warp calls it (the shuffles), for rows of its quad alike.
template <typename GatePair, typename UpPair>
__device__ __forceinline__ void swiglu_quantize_fragment_row(const GatePair& gate, const UpPair& up,
                                                             float limit, uint8_t* codes_row,
                                                             float* scale) {
  uint32_t h[16];
  uint32_t pair_amax = 0;  // two bf16 magnitudes, NaN-propagating (HMNMX2)
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    h[j] = bf16x2_bits(swiglu_forward_pair(bf16x2_of_bits(gate(j)), bf16x2_of_bits(up(j)), limit));
    pair_amax = ptx::max_abs_bf16x2_nan(pair_amax, h[j]);
  }
  // The halves' signs are XORs of the inputs' (max_abs_bf16x2_nan): take the magnitudes.
  float amax = ptx::max_nan(fabsf(__uint_as_float(pair_amax << 16)),
                            fabsf(__uint_as_float(pair_amax & 0xffff0000u)));
  amax = ptx::max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
  amax = ptx::max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
  const Fp8GroupScale factors = fp8_group_scale(amax);
  uint32_t code_pairs[16];  // 2 bytes each, in the low half
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const float2 v = __bfloat1622float2(bf16x2_of_bits(h[j]));
    code_pairs[j] = __nv_cvt_float2_to_fp8x2(
        make_float2(v.x * factors.inverse_scale, v.y * factors.inverse_scale), __NV_SATFINITE,
        __NV_E4M3);
  }
  // The exchange: thread q's run a (columns 8 (4 a + q) ..) takes pair 4 a + q of each thread
  // q' at bytes 2 q'. Round r: each thread sends the thread r ahead the pairs that one wants and
  // receives those of the thread r behind; runs a and a + 1 travel in one word. Every index that
  // depends on the lane goes through selects (fp8_pick_of_four), not a register array.
  const int lane = threadIdx.x % 32, q = lane % 4;
#pragma unroll
  for (int a = 0; a < 4; a += 2) {
    uint32_t got[4];  // round r's word: thread (q - r) & 3's pairs for runs a (low), a + 1 (high)
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int wanted = (q + r) & 3;
      const uint32_t word = fp8_pick_of_four(code_pairs[4 * a], code_pairs[4 * a + 1],
                                             code_pairs[4 * a + 2], code_pairs[4 * a + 3], wanted) |
                            (fp8_pick_of_four(code_pairs[4 * a + 4], code_pairs[4 * a + 5],
                                              code_pairs[4 * a + 6], code_pairs[4 * a + 7], wanted)
                             << 16);
      got[r] = r == 0 ? word : __shfl_sync(0xffffffffu, word, (lane & ~3) | ((q - r) & 3));
    }
    // Thread s's pairs came in round (q - s) & 3; they go to bytes 2 s of the runs.
    uint32_t from[4];
#pragma unroll
    for (int sender = 0; sender < 4; ++sender)
      from[sender] = fp8_pick_of_four(got[0], got[1], got[2], got[3], (q - sender) & 3);
    const uint2 run_low =
        make_uint2((from[0] & 0xffffu) | (from[1] << 16), (from[2] & 0xffffu) | (from[3] << 16));
    const uint2 run_high = make_uint2((from[0] >> 16) | (from[1] & 0xffff0000u),
                                      (from[2] >> 16) | (from[3] & 0xffff0000u));
    *reinterpret_cast<uint2*>(codes_row + 8 * (4 * a + q)) = run_low;
    *reinterpret_cast<uint2*>(codes_row + 8 * (4 * (a + 1) + q)) = run_high;
  }
  if (q == 0) *scale = factors.scale;
}

// Both fragment rows of a consumer warpgroup's 64 rows from `row_base` (a row of the [R, I]
// outputs) into h's group `group`: g's pair j of fragment row i as `gate(i, j)`, u's as `up(i, j)`.
template <typename GatePair, typename UpPair>
__device__ __forceinline__ void swiglu_quantize_fragment_rows(const Fp8GemmParams& params,
                                                              int64_t row_base, int group,
                                                              const GatePair& gate,
                                                              const UpPair& up) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int64_t row = row_base + fragment_row(i);
    swiglu_quantize_fragment_row(
        [&](int j) { return gate(i, j); }, [&](int j) { return up(i, j); }, params.swiglu_limit,
        static_cast<uint8_t*>(params.swiglu_h_codes) + row * params.n_split + group * 128,
        params.swiglu_h_scales + group * params.swiglu_h_rows + row);
  }
}

}  // namespace mok::kernels
