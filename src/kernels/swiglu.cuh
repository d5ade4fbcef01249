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

}  // namespace mok::kernels
