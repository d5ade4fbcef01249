// SwiGLU backward as its own memory-bound pass, after the dgrad GEMM of down has stored dh_raw:
// per element d_g, d_u and h_w = bf16(w h) (docs/design.md, backward steps 2-4), and per row
// d_router_weights = <dh_raw, h> computed directly (right for zero and negative weights).
//
// Roles: one warp per row (swiglu_backward.cuh, shared with the persistent backward); lanes walk
// the row's columns in 8-element (16-byte) vectors, so loads and stores are coalesced.
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/stages/launch.h"
#include "kernels/stages/swiglu_backward.cuh"

namespace mok::kernels {

namespace {

__global__ void swiglu_backward_kernel(SwigluBackwardArgs args, const ScheduleHeader* header,
                                       int64_t num_rows, int64_t row_count) {
  const int64_t rows = header != nullptr ? header->total_rows : num_rows;
  const int64_t end = row_count < rows - args.row_begin ? args.row_begin + row_count : rows;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  for (int64_t row =
           args.row_begin + (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
       row < end; row += warps)
    swiglu_backward_row(args, row);
  // Expert parallel: the stores above went to other GPUs; make them visible at system scope
  // before the push kernel's signal (which only orders its own CTAs' stores) tells the source.
  if (args.d_router_weights_peers != nullptr) __threadfence_system();
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
  const SwigluBackwardArgs args = make_swiglu_backward_args(
      gate, up, dh_raw, row_pair, router_weights, intermediate, limit, d_gate, d_up,
      weighted_hidden, d_router_weights, d_router_weights_peers, pairs_per_rank, row_begin);
  swiglu_backward_kernel<<<sm_count * 8, 256, 0, stream>>>(args, header, num_rows, row_count);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("swiglu_backward.cu", {kernel_symbol(&swiglu_backward_kernel)});
}  // namespace

}  // namespace mok::kernels
