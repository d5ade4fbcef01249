// The SwiGLU backward of one row, as device functions for one warp: the standalone pass
// (swiglu_backward.cu, one warp per row over the grid, reading global memory) and the persistent
// backward's SwiGLU task (backward_gemms.cu, the consumer warps over a 128-row tile that TMA
// streams through shared memory) both walk a row the same way through these functions, so the
// bits are the same whichever kernel runs it.
//
// Per element: d_g, d_u and h_w = bf16(w h) (docs/design.md, backward steps 2-4); per row:
// d_router_weights = <dh_raw, h> in one fixed order, whichever kernel computes it (one producer,
// one order):
//   1. an 8-column vector's products e0..e7: ((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 + e7));
//   2. a 256-column group's 32 vectors: a balanced tree, vector l and l ^ 1 first, then pairs of
//      those, ... (a warp's xor butterfly over lanes 1, 2, 4, 8, 16); vectors past the row's
//      end count +0;
//   3. the groups in column order from 0: ((0 + s_0) + s_1) + ...
// The order is built for the down dgrad's SwiGLU epilogue (dgated_epilogue.cuh), where a
// thread's accumulators hold two columns of each vector and one column tile is one group: there
// the pairs meet across four threads, the tree over the tile's vectors stays in each thread's
// registers, and the groups (column tiles, other CTAs) are summed by a pass after the GEMM
// (launch_router_weight_grad_sum). Lane-per-vector kernels (the standalone pass, the persistent
// task, the FP8 pass) pay four more shuffles per row and group than a per-lane running sum.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/stages/swiglu.cuh"

namespace mok::kernels {

// The row's weight: its pair's router weight, 0 for a padding row, 1 without router weights.
__device__ __forceinline__ float swiglu_row_weight(const SwigluBackwardArgs& args, int pair) {
  return pair < 0 ? 0.0f : args.router_weights != nullptr ? args.router_weights[pair] : 1.0f;
}

// One 8-element vector of a row: d_g, d_u and h_w out (each rounded once, by its bf16 pack:
// swiglu_backward_of_bf16), and <dh_raw, h> of its elements in step 1's order.
// The operands by value: a reference into global memory compiled to a 32-bit load per pair.
__device__ __forceinline__ void swiglu_backward_vector(const uint4 g, const uint4 u, const uint4 dh,
                                                       float weight, float limit, float& vector_dot,
                                                       uint4& dg_out, uint4& du_out,
                                                       uint4& hw_out) {
  const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&g);
  const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&u);
  const __nv_bfloat162* dh2 = reinterpret_cast<const __nv_bfloat162*>(&dh);
  __nv_bfloat162* dg2 = reinterpret_cast<__nv_bfloat162*>(&dg_out);
  __nv_bfloat162* du2 = reinterpret_cast<__nv_bfloat162*>(&du_out);
  __nv_bfloat162* hw2 = reinterpret_cast<__nv_bfloat162*>(&hw_out);
  float pair_dot[4];
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const float2 gf = __bfloat1622float2(g2[p]), uf = __bfloat1622float2(u2[p]),
                 df = __bfloat1622float2(dh2[p]);
    const SwigluGrad low = swiglu_backward_of_bf16(df.x, gf.x, uf.x, weight, limit);
    const SwigluGrad high = swiglu_backward_of_bf16(df.y, gf.y, uf.y, weight, limit);
    pair_dot[p] = low.dh_raw_times_h + high.dh_raw_times_h;
    dg2[p] = __floats2bfloat162_rn(low.d_gate, high.d_gate);
    du2[p] = __floats2bfloat162_rn(low.d_up, high.d_up);
    hw2[p] = __floats2bfloat162_rn(low.weighted_hidden, high.weighted_hidden);
  }
  vector_dot = (pair_dot[0] + pair_dot[1]) + (pair_dot[2] + pair_dot[3]);
}

// Step 2 over a warp whose lane l holds vector l of a group (+0 past the row's end): the
// group's sum, the same in every lane. kLanes 16: each half-warp on its own, over half a group
// (the FP8 pass: a half-warp per row and 128-column chunk; it adds the halves as the tree's
// last level).
template <int kLanes = 32>
__device__ __forceinline__ float router_dot_group(float vector_dot) {
#pragma unroll
  for (int offset = 1; offset < kLanes; offset *= 2)
    vector_dot += __shfl_xor_sync(0xffffffffu, vector_dot, offset);
  return vector_dot;
}

// The router weight's gradient of a routed pair (pair >= 0), by the calling thread.
__device__ __forceinline__ void store_router_weight_grad(const SwigluBackwardArgs& args, int pair,
                                                         float dot) {
  if (args.d_router_weights_peers != nullptr)  // expert parallel: the source rank's buffer
    args.d_router_weights_peers[pair / args.pairs_per_rank][pair % args.pairs_per_rank] = dot;
  else if (args.d_router_weights != nullptr)
    args.d_router_weights[pair] = dot;
}

// A padding row (pair < 0) gets d_g = d_u = h_w = +0 exactly, not the math with weight 0: its x
// and d_out rows are zero, so every weight-gradient term it adds is 0 * 0 whatever the weights
// hold. From the math, a NaN or infinite weight would make its g, u or dh_raw NaN (0 * inf), and
// 0 * NaN is NaN: a padding row would turn an expert's finite or infinite gradient NaN where the
// reference, which has no padding rows, keeps it.
__device__ __forceinline__ void swiglu_store_padding_vector(const SwigluBackwardArgs& args,
                                                            int64_t at) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  args.d_gate[at] = zero;
  args.d_up[at] = zero;
  args.weighted_hidden[at] = zero;
}

// Schedule row `row`, by the 32 lanes of the calling warp: group by group (lane l takes vector
// l of each 256-column group), kSwigluVectorsInFlight groups at a time, all their vectors loaded
// before any is computed and stored (one at a time, the loads could not pass the stores, since
// weighted_hidden may alias dh_raw: 2% slower, docs/perf.md, session 38). A lane reads each
// element before it writes it, so the aliasing still holds.
constexpr int kSwigluVectorsInFlight = 4;

__device__ __forceinline__ void swiglu_backward_row(const SwigluBackwardArgs& args, int64_t row) {
  const int lane = threadIdx.x % 32;
  const int pair = args.row_pair != nullptr ? args.row_pair[row] : static_cast<int>(row);
  const int64_t row_at = (row - args.row_begin) * args.vectors_per_row;
  if (pair < 0) {
    for (int64_t v = lane; v < args.vectors_per_row; v += 32)
      swiglu_store_padding_vector(args, row_at + v);
    return;
  }
  const float weight = swiglu_row_weight(args, pair);
  float dot = 0.0f;
  // Warp-uniform bounds (the groups), each lane's vector guarded: the tree's shuffles need every
  // lane.
  for (int64_t base = 0; base < args.vectors_per_row; base += 32 * kSwigluVectorsInFlight) {
    uint4 g[kSwigluVectorsInFlight], u[kSwigluVectorsInFlight], dh[kSwigluVectorsInFlight];
#pragma unroll
    for (int q = 0; q < kSwigluVectorsInFlight; ++q) {
      const int64_t v = base + 32 * q + lane;
      if (v >= args.vectors_per_row) continue;
      g[q] = args.gate[row_at + v];
      u[q] = args.up[row_at + v];
      dh[q] = args.dh_raw[row_at + v];
    }
#pragma unroll
    for (int q = 0; q < kSwigluVectorsInFlight; ++q) {
      if (base + 32 * q >= args.vectors_per_row) break;  // no such group
      const int64_t v = base + 32 * q + lane;
      float vector_dot = 0.0f;
      if (v < args.vectors_per_row) {
        uint4 dg_out, du_out, hw_out;
        swiglu_backward_vector(g[q], u[q], dh[q], weight, args.limit, vector_dot, dg_out, du_out,
                               hw_out);
        args.d_gate[row_at + v] = dg_out;
        args.d_up[row_at + v] = du_out;
        args.weighted_hidden[row_at + v] = hw_out;
      }
      dot += router_dot_group(vector_dot);
    }
  }
  if (lane == 0) store_router_weight_grad(args, pair, dot);
}

}  // namespace mok::kernels
