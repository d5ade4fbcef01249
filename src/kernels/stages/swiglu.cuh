// SwiGLU on the GPU, with the clamp and the rounding points of docs/design.md: gate and up
// arrive as fp32 accumulators, are rounded to bf16, clamped, and combined in fp32.
//
// Division: `a / b` compiles to a fast path (reciprocal, one Newton step, quotient, FMA
// residual, corrected quotient) and a check that branches to a slow-path call for operands
// where that sequence could under- or overflow. The branch splits the code at every division,
// so the elements of a vector ran one after the other (~80 instructions each, SASS) and the
// SwiGLU steps on few warps (the epilogue, the persistent backward's SwiGLU task) were bound by
// latency. The kFast forms below run the same fast-path sequence without the branch on a range
// where it cannot under- or overflow, where it is correctly rounded, as `a / b` is: the same
// bits. Outside that range (rare: a huge negative gate, a tiny nonzero one, NaN) they report
// it and the caller computes the vector again with `a / b`.
#pragma once

#include <cuda_bf16.h>

#include "kernels/common/ptx.cuh"

namespace mok::kernels {

__device__ __forceinline__ float round_bf16(float value) {
  return __bfloat162float(__float2bfloat16_rn(value));
}

// a / b for 1 <= b <= 2^60 and a = 0 or 2^-60 <= |a| <= 2^60, with no branch; `in_range`
// turns false for operands outside that range (the result is then not to be used).
__device__ __forceinline__ float divide_in_range(float a, float b, bool& in_range) {
  const float magnitude = fabsf(a);
  // Bitwise, not short-circuit: `&&` here compiled to branches around each comparison.
  in_range &= (b >= 1.0f) & (b <= 0x1p60f) &
              ((a == 0.0f) | ((magnitude >= 0x1p-60f) & (magnitude <= 0x1p60f)));
  const float reciprocal = ptx::reciprocal_approx_ftz(b);
  const float error = __fmaf_rn(-b, reciprocal, 1.0f);
  const float refined = __fmaf_rn(reciprocal, error, reciprocal);
  const float quotient = __fmaf_rn(a, refined, 0.0f);
  const float residual = __fmaf_rn(-b, quotient, a);
  const float result = __fmaf_rn(refined, residual, quotient);
  return a == 0.0f ? a : result;  // +-0 / b = +-0 (the sequence's +0 addend loses the sign)
}

template <bool kFast>
__device__ __forceinline__ float divide(float a, float b, bool& in_range) {
  if constexpr (kFast)
    return divide_in_range(a, b, in_range);
  else
    return a / b;
}

// 1 + exp(-g) = 1 + 2^(-g log2(e)) on MUFU.EX2.
__device__ __forceinline__ float sigmoid_denominator(float gate) {
  return 1.0f + ptx::exp2_approx_ftz(gate * -1.4426950408889634f);
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
// g = min(gate, L), u = clamp(up, -L, L). kFast: see the top of the file (`in_range` false:
// compute again with kFast = false).
template <bool kFast = false>
__device__ __forceinline__ float swiglu_forward_of_bf16(float gate_bf16, float up_bf16, float limit,
                                                        bool& in_range) {
  const float gate = clamp_gate(gate_bf16, limit);
  const float up = clamp_up(up_bf16, limit);
  const float silu = gate * ptx::reciprocal_approx_ftz(sigmoid_denominator(gate));
  return silu * up;
}

// h = bf16(silu(g) * u) with g = min(bf16(gate), L), u = clamp(bf16(up), -L, L), from fp32
// accumulators.
template <bool kFast = false>
__device__ __forceinline__ float swiglu_forward(float gate_acc, float up_acc, float limit,
                                                bool& in_range) {
  return swiglu_forward_of_bf16<kFast>(round_bf16(gate_acc), round_bf16(up_acc), limit, in_range);
}

__device__ __forceinline__ float swiglu_forward(float gate_acc, float up_acc, float limit) {
  bool unused = true;
  return swiglu_forward<false>(gate_acc, up_acc, limit, unused);
}

// h of one 8-element unit of bf16 gate and up values, kFast or not. Returns false if kFast met an
// operand outside its range (`h` is then not to be used: compute it again with kFast = false).
// The values are bf16 already, so swiglu_forward's two roundings are left out: they are the
// identity on them, and a NaN turns canonical in the clamps either way (min/max .NaN), so the
// bits are the same with four fewer instructions an element.
template <bool kFast>
__device__ __forceinline__ bool swiglu_forward_unit(const uint4& gate, const uint4& up, float limit,
                                                    uint4& h) {
  const __nv_bfloat162* gate_pairs = reinterpret_cast<const __nv_bfloat162*>(&gate);
  const __nv_bfloat162* up_pairs = reinterpret_cast<const __nv_bfloat162*>(&up);
  __nv_bfloat162* h_pairs = reinterpret_cast<__nv_bfloat162*>(&h);
  bool in_range = true;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const float2 g = __bfloat1622float2(gate_pairs[p]), u = __bfloat1622float2(up_pairs[p]);
    h_pairs[p] = __floats2bfloat162_rn(swiglu_forward_of_bf16<kFast>(g.x, u.x, limit, in_range),
                                       swiglu_forward_of_bf16<kFast>(g.y, u.y, limit, in_range));
  }
  return in_range;
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
template <bool kFast = false>
__device__ __forceinline__ SwigluGrad swiglu_backward_of_bf16(float dh_raw, float gate_raw,
                                                              float up_raw, float weight,
                                                              float limit, bool& in_range) {
  const bool gate_passes = !(gate_raw > limit);
  const bool up_passes = !(fabsf(up_raw) > limit);
  const float gate = clamp_gate(gate_raw, limit);
  const float up = clamp_up(up_raw, limit);
  const float sigmoid = ptx::reciprocal_approx_ftz(sigmoid_denominator(gate));
  const float silu = gate * sigmoid;
  const float hidden = round_bf16(silu * up);
  const float dh = weight * dh_raw;
  SwigluGrad grad;
  grad.dh_raw_times_h = dh_raw * hidden;
  grad.d_up = up_passes ? dh * silu : 0.0f;
  grad.d_gate = gate_passes ? dh * up * sigmoid * (1.0f + gate * (1.0f - sigmoid)) : 0.0f;
  grad.weighted_hidden = weight * hidden;
  return grad;
}

template <bool kFast = false>
__device__ __forceinline__ SwigluGrad swiglu_backward(float dh_acc, float gate_raw, float up_raw,
                                                      float weight, float limit, bool& in_range) {
  SwigluGrad grad =
      swiglu_backward_of_bf16<kFast>(round_bf16(dh_acc), gate_raw, up_raw, weight, limit, in_range);
  grad.d_gate = round_bf16(grad.d_gate);
  grad.d_up = round_bf16(grad.d_up);
  grad.weighted_hidden = round_bf16(grad.weighted_hidden);
  return grad;
}

}  // namespace mok::kernels
