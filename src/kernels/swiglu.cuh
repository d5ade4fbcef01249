// SwiGLU on the GPU, with the clamp and the rounding points of docs/design.md: gate and up
// arrive as fp32 accumulators, are rounded to bf16, clamped, and combined in fp32.
#pragma once

#include <cuda_bf16.h>

namespace mok::kernels {

__device__ __forceinline__ float round_bf16(float value) {
  return __bfloat162float(__float2bfloat16_rn(value));
}

// h = bf16(silu(g) * u) with g = min(bf16(gate), L), u = clamp(bf16(up), -L, L).
__device__ __forceinline__ float swiglu_forward(float gate_acc, float up_acc, float limit) {
  const float gate = fminf(round_bf16(gate_acc), limit);
  const float up = fminf(fmaxf(round_bf16(up_acc), -limit), limit);
  const float silu = gate / (1.0f + expf(-gate));
  return silu * up;
}

// One element of the SwiGLU backward (docs/design.md, backward steps 1-4): from the dgrad
// accumulator of down (dh_raw before rounding), the stored bf16 gate/up values and the router
// weight w of the row.
struct SwigluGrad {
  float dh_raw_times_h;   // dh_raw * h: this element's share of d_router_weights
  float d_gate;           // bf16 value, 0 where the gate was clamped
  float d_up;             // bf16 value, 0 where the up value was clamped
  float weighted_hidden;  // bf16(w * h), operand of the down-weight gradient
};

__device__ __forceinline__ SwigluGrad swiglu_backward(float dh_acc, float gate_raw, float up_raw,
                                                      float weight, float limit) {
  const float dh_raw = round_bf16(dh_acc);
  const bool gate_passes = !(gate_raw > limit);
  const bool up_passes = !(fabsf(up_raw) > limit);
  const float gate = fminf(gate_raw, limit);
  const float up = fminf(fmaxf(up_raw, -limit), limit);
  const float denominator = 1.0f + expf(-gate);
  const float silu = gate / denominator;
  const float sigmoid = 1.0f / denominator;
  const float hidden = round_bf16(silu * up);
  const float dh = weight * dh_raw;
  SwigluGrad grad;
  grad.dh_raw_times_h = dh_raw * hidden;
  grad.d_up = up_passes ? round_bf16(dh * silu) : 0.0f;
  grad.d_gate =
      gate_passes ? round_bf16(dh * up * sigmoid * (1.0f + gate * (1.0f - sigmoid))) : 0.0f;
  grad.weighted_hidden = round_bf16(weight * hidden);
  return grad;
}

}  // namespace mok::kernels
