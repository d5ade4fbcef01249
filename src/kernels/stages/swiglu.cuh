// SwiGLU on the GPU, with the clamp and the rounding points of docs/design.md: gate and up
// arrive as fp32 accumulators, are rounded to bf16, clamped, and combined in fp32.
//
// exp and the division run on the SFU: sigmoid(g) = 1 / (1 + 2^(-g log2 e)) and silu(g) = g *
// sigmoid(g), with MUFU.EX2 and MUFU.RCP (relative errors ~2^-22 and ~2^-23; the product g log2 e
// adds |g| 2^-24). That is a few fp32 ulps before the bf16 rounding of h, d_g and d_u
// (2^-9), and about 10 instructions an element of the forward where expf and an IEEE division took
// ~28 (docs/design.md, "SwiGLU on the SFU"). Every GPU path runs these functions, so their bits
// agree; against the CPU reference (std::exp, `/`) they agree to the bf16 tolerance, as expf did.
#pragma once

#include <cuda_bf16.h>

#include "kernels/common/ptx.cuh"

namespace mok::kernels {

__device__ __forceinline__ float round_bf16(float value) {
  return __bfloat162float(__float2bfloat16_rn(value));
}

// 1 / (1 + exp(-g)) = rcp((1 + 2^(-g log2 e)) / 16) / 16. The scaled denominator (one FFMA, as
// exact as the sum) is at most 2^124, so MUFU.RCP's result stays normal, and the last product
// keeps a subnormal sigmoid, which MUFU.RCP would flush (gates -88.7 .. -87.3): sigmoid and silu
// are then zero exactly where exp(-g) overflows fp32, as in the reference, and an infinite up or
// dh_raw meets the reference's zero or tiny factor (a NaN or an infinity, docs/design.md).
__device__ __forceinline__ float sigmoid(float gate) {
  const float power = ptx::exp2_approx_ftz(gate * -1.4426950408889634f);
  return ptx::reciprocal_approx_ftz(__fmaf_rn(power, 0x1p-4f, 0x1p-4f)) * 0x1p-4f;
}

// The clamp of docs/design.md, g = min(g, L) and u = clamp(u, -L, L), with a NaN value kept NaN
// as in the reference (fminf / fmaxf would return the limit: without a clamp a NaN gate became
// +inf and a NaN up value -inf, so h, d_u and the weight gradients turned finite or infinite
// where the reference's are NaN). L is positive, never NaN (can_implement).
__device__ __forceinline__ float clamp_gate(float gate, float limit) {
  return ptx::min_nan(gate, limit);
}
__device__ __forceinline__ float clamp_up(float up, float limit) {
  return ptx::min_nan(ptx::max_nan(up, -limit), limit);
}

// silu(g) * u of gate and up values already rounded to bf16 (a staged tile, stored rows), with
// g = min(gate, L), u = clamp(up, -L, L).
__device__ __forceinline__ float swiglu_forward_of_bf16(float gate_bf16, float up_bf16,
                                                        float limit) {
  const float gate = clamp_gate(gate_bf16, limit);
  const float up = clamp_up(up_bf16, limit);
  return gate * sigmoid(gate) * up;
}

// h = bf16(silu(g) * u) with g = min(bf16(gate), L), u = clamp(bf16(up), -L, L), from fp32
// accumulators.
__device__ __forceinline__ float swiglu_forward(float gate_acc, float up_acc, float limit) {
  return swiglu_forward_of_bf16(round_bf16(gate_acc), round_bf16(up_acc), limit);
}

// h of a pair, and of one 8-element unit, of bf16 gate and up values. The values are bf16 already,
// so swiglu_forward's two roundings are left out: they are the identity on them, and a NaN turns
// canonical in the clamps either way (min/max .NaN), so the bits are the same with four fewer
// instructions an element.
__device__ __forceinline__ __nv_bfloat162 swiglu_forward_pair(__nv_bfloat162 gate,
                                                              __nv_bfloat162 up, float limit) {
  const float2 g = __bfloat1622float2(gate), u = __bfloat1622float2(up);
  return __floats2bfloat162_rn(swiglu_forward_of_bf16(g.x, u.x, limit),
                               swiglu_forward_of_bf16(g.y, u.y, limit));
}
__device__ __forceinline__ uint4 swiglu_forward_unit(const uint4& gate, const uint4& up,
                                                     float limit) {
  const __nv_bfloat162* gate_pairs = reinterpret_cast<const __nv_bfloat162*>(&gate);
  const __nv_bfloat162* up_pairs = reinterpret_cast<const __nv_bfloat162*>(&up);
  uint4 h;
  __nv_bfloat162* h_pairs = reinterpret_cast<__nv_bfloat162*>(&h);
#pragma unroll
  for (int p = 0; p < 4; ++p) h_pairs[p] = swiglu_forward_pair(gate_pairs[p], up_pairs[p], limit);
  return h;
}

// One element of the SwiGLU backward (docs/design.md, backward steps 1-4): from the dgrad
// accumulator of down (dh_raw before rounding), the stored bf16 gate/up values and the router
// weight w of the row.
struct SwigluGrad {
  float dh_raw_times_h;   // dh_raw * h: this element's share of d_router_weights
  float d_gate;           // bf16 value, 0 where the gate was clamped (unrounded: _of_bf16)
  float d_up;             // bf16 value, 0 where the up value was clamped (unrounded: _of_bf16)
  float weighted_hidden;  // bf16(w * h), operand of the down-weight gradient (unrounded: _of_bf16)
};

// The element from dh_raw, gate and up values that are bf16 already (stored rows), with d_gate,
// d_up and weighted_hidden left for the caller's bf16 pack to round (__floats2bfloat162_rn
// rounds each once, as round_bf16 does): swiglu_backward's bits with fewer instructions. The
// rounding of dh_raw is the identity on a bf16 value; on a NaN one (whose payload it would make
// canonical) every result is a product of it, and the GPU's NaN products are canonical either
// way.
__device__ __forceinline__ SwigluGrad swiglu_backward_of_bf16(float dh_raw, float gate_raw,
                                                              float up_raw, float weight,
                                                              float limit) {
  const bool gate_passes = !(gate_raw > limit);
  const bool up_passes = !(fabsf(up_raw) > limit);
  const float gate = clamp_gate(gate_raw, limit);
  const float up = clamp_up(up_raw, limit);
  const float sig = sigmoid(gate);
  const float silu = gate * sig;
  const float hidden = round_bf16(silu * up);
  const float dh = weight * dh_raw;
  SwigluGrad grad;
  grad.dh_raw_times_h = dh_raw * hidden;
  grad.d_up = up_passes ? dh * silu : 0.0f;
  grad.d_gate = gate_passes ? dh * up * sig * (1.0f + gate * (1.0f - sig)) : 0.0f;
  grad.weighted_hidden = weight * hidden;
  return grad;
}

__device__ __forceinline__ SwigluGrad swiglu_backward(float dh_acc, float gate_raw, float up_raw,
                                                      float weight, float limit) {
  SwigluGrad grad = swiglu_backward_of_bf16(round_bf16(dh_acc), gate_raw, up_raw, weight, limit);
  grad.d_gate = round_bf16(grad.d_gate);
  grad.d_up = round_bf16(grad.d_up);
  grad.weighted_hidden = round_bf16(grad.weighted_hidden);
  return grad;
}

}  // namespace mok::kernels
