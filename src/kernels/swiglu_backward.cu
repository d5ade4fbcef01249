// SwiGLU backward as its own memory-bound pass, after the dgrad GEMM of down has stored dh_raw:
// per element d_g, d_u and h_w = bf16(w h) (docs/design.md, backward steps 2-4), and per row
// d_router_weights = <dh_raw, h> computed directly (right for zero and negative weights).
//
// Roles: one warp per row; lanes walk the row's columns in 8-element (16-byte) vectors, so loads
// and stores are coalesced; the row's dot product is summed per lane in column order, then over
// lanes with a fixed xor tree: one producer, one order, deterministic.
#include <cuda_bf16.h>

#include "kernels/kernel_preload.h"
#include "kernels/launchers.h"
#include "kernels/swiglu.cuh"

namespace mok::kernels {

namespace {

__global__ void swiglu_backward_kernel(const ScheduleHeader* header, int64_t num_rows,
                                       const uint4* gate, const uint4* up, const uint4* dh_raw,
                                       const int32_t* row_pair, const float* router_weights,
                                       int64_t vectors_per_row, float limit, uint4* d_gate,
                                       uint4* d_up, uint4* weighted_hidden, float* d_router_weights,
                                       float* const* d_router_weights_peers, int32_t pairs_per_rank,
                                       int64_t row_begin, int64_t row_count) {
  const int64_t rows = header != nullptr ? header->total_rows : num_rows;
  const int64_t end = row_count < rows - row_begin ? row_begin + row_count : rows;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t row = row_begin + (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
       row < end; row += warps) {
    const int pair = row_pair != nullptr ? row_pair[row] : static_cast<int>(row);
    const float weight = pair < 0 ? 0.0f : router_weights != nullptr ? router_weights[pair] : 1.0f;
    float dot = 0.0f;
    for (int64_t v = lane; v < vectors_per_row; v += 32) {
      const int64_t at = (row - row_begin) * vectors_per_row + v;
      const uint4 g = gate[at], u = up[at], dh = dh_raw[at];
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
        const SwigluGrad low = swiglu_backward(df.x, gf.x, uf.x, weight, limit);
        const SwigluGrad high = swiglu_backward(df.y, gf.y, uf.y, weight, limit);
        dot += low.dh_raw_times_h;
        dot += high.dh_raw_times_h;
        dg2[p] = __floats2bfloat162_rn(low.d_gate, high.d_gate);
        du2[p] = __floats2bfloat162_rn(low.d_up, high.d_up);
        hw2[p] = __floats2bfloat162_rn(low.weighted_hidden, high.weighted_hidden);
      }
      d_gate[at] = dg_out;
      d_up[at] = du_out;
      weighted_hidden[at] = hw_out;
    }
    for (int offset = 16; offset > 0; offset /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    if (lane == 0 && pair >= 0) {
      if (d_router_weights_peers != nullptr)  // expert parallel: into the source rank's buffer
        d_router_weights_peers[pair / pairs_per_rank][pair % pairs_per_rank] = dot;
      else if (d_router_weights != nullptr)
        d_router_weights[pair] = dot;
    }
  }
  // Expert parallel: the stores above went to other GPUs; make them visible at system scope
  // before the push kernel's signal (which only orders its own CTAs' stores) tells the source.
  if (d_router_weights_peers != nullptr) __threadfence_system();
}

}  // namespace

cudaError_t launch_swiglu_backward(const ScheduleHeader* header, int64_t num_rows, const void* gate,
                                   const void* up, const void* dh_raw, const int32_t* row_pair,
                                   const float* router_weights, int64_t intermediate, float limit,
                                   void* d_gate, void* d_up, void* weighted_hidden,
                                   float* d_router_weights, float* const* d_router_weights_peers,
                                   int32_t pairs_per_rank, cudaStream_t stream, int64_t row_begin,
                                   int64_t row_count) {
  if (header == nullptr && num_rows == 0) return cudaSuccess;
  if (row_begin < 0 || row_count < 0) return cudaErrorInvalidValue;
  int device = 0, sm_count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  swiglu_backward_kernel<<<sm_count * 8, 256, 0, stream>>>(
      header, num_rows, static_cast<const uint4*>(gate), static_cast<const uint4*>(up),
      static_cast<const uint4*>(dh_raw), row_pair, router_weights, intermediate / 8, limit,
      static_cast<uint4*>(d_gate), static_cast<uint4*>(d_up), static_cast<uint4*>(weighted_hidden),
      d_router_weights, d_router_weights_peers, pairs_per_rank, row_begin, row_count);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("swiglu_backward.cu", {kernel_symbol(&swiglu_backward_kernel)});
}  // namespace

}  // namespace mok::kernels
