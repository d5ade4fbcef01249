// The SwiGLU backward of one row, as a device function for one warp: the standalone pass
// (swiglu_backward.cu, one warp per row over the grid) and the persistent backward's SwiGLU task
// (backward_gemms.cu, the consumer warps over a 128-row tile) both call it, so the bits are the
// same whichever kernel runs it.
//
// Per element: d_g, d_u and h_w = bf16(w h) (docs/design.md, backward steps 2-4); per row:
// d_router_weights = <dh_raw, h>, summed per lane in column order, then over lanes with a fixed
// xor tree (one producer, one order).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/expert_gemm_params.h"
#include "kernels/swiglu.cuh"

namespace mok::kernels {

// Schedule row `row`, by the 32 lanes of the calling warp.
__device__ __forceinline__ void swiglu_backward_row(const SwigluBackwardArgs& args, int64_t row) {
  const int lane = threadIdx.x % 32;
  const int pair = args.row_pair != nullptr ? args.row_pair[row] : static_cast<int>(row);
  const float weight = pair < 0                         ? 0.0f
                       : args.router_weights != nullptr ? args.router_weights[pair]
                                                        : 1.0f;
  float dot = 0.0f;
  for (int64_t v = lane; v < args.vectors_per_row; v += 32) {
    const int64_t at = (row - args.row_begin) * args.vectors_per_row + v;
    const uint4 g = args.gate[at], u = args.up[at], dh = args.dh_raw[at];
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&g);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&u);
    const __nv_bfloat162* dh2 = reinterpret_cast<const __nv_bfloat162*>(&dh);
    uint4 dg_out, du_out, hw_out;
    __nv_bfloat162* dg2 = reinterpret_cast<__nv_bfloat162*>(&dg_out);
    __nv_bfloat162* du2 = reinterpret_cast<__nv_bfloat162*>(&du_out);
    __nv_bfloat162* hw2 = reinterpret_cast<__nv_bfloat162*>(&hw_out);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const float2 gf = __bfloat1622float2(g2[p]), uf = __bfloat1622float2(u2[p]),
                   df = __bfloat1622float2(dh2[p]);
      const SwigluGrad low = swiglu_backward(df.x, gf.x, uf.x, weight, args.limit);
      const SwigluGrad high = swiglu_backward(df.y, gf.y, uf.y, weight, args.limit);
      dot += low.dh_raw_times_h;
      dot += high.dh_raw_times_h;
      dg2[p] = __floats2bfloat162_rn(low.d_gate, high.d_gate);
      du2[p] = __floats2bfloat162_rn(low.d_up, high.d_up);
      hw2[p] = __floats2bfloat162_rn(low.weighted_hidden, high.weighted_hidden);
    }
    args.d_gate[at] = dg_out;
    args.d_up[at] = du_out;
    args.weighted_hidden[at] = hw_out;
  }
  for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  if (lane == 0 && pair >= 0) {
    if (args.d_router_weights_peers != nullptr)  // expert parallel: the source rank's buffer
      args.d_router_weights_peers[pair / args.pairs_per_rank][pair % args.pairs_per_rank] = dot;
    else if (args.d_router_weights != nullptr)
      args.d_router_weights[pair] = dot;
  }
}

}  // namespace mok::kernels
