// SwiGLU backward as its own memory-bound pass, after the dgrad GEMM of down has stored dh_raw:
// per element d_g, d_u and h_w = bf16(w h) (docs/design.md, backward steps 2-4), and per row
// d_router_weights = <dh_raw, h> computed directly (right for zero and negative weights).
//
// Roles: one warp per row (swiglu_backward.cuh, shared with the persistent backward); lanes walk
// the row's columns in 8-element (16-byte) vectors, so loads and stores are coalesced.
// Also here: the sum of the router weights' gradient partials that the down dgrad's SwiGLU
// epilogue leaves per column tile (ExpertGemmForm::kDownGradSwiGLU), one thread per row.
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/common/overlapped_launch.h"
#include "kernels/common/ptx.cuh"
#include "kernels/stages/launch.h"
#include "kernels/stages/swiglu_backward.cuh"

namespace mok::kernels {

namespace {

__global__ void swiglu_backward_kernel(SwigluBackwardArgs args, const ScheduleHeader* header,
                                       int64_t num_rows, int64_t row_count) {
  ptx::begin_after_previous_kernel();
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

// The routed rows' partials summed in column-tile order (launch_router_weight_grad_sum).
__global__ void router_weight_grad_sum_kernel(const ScheduleHeader* header, const float* partials,
                                              int64_t partial_rows, const int32_t* row_pair,
                                              int32_t column_tiles, SwigluBackwardArgs out,
                                              int64_t row_begin, int64_t row_count) {
  ptx::begin_after_previous_kernel();
  const int64_t rows = header->total_rows;
  const int64_t end = row_count < rows - row_begin ? row_begin + row_count : rows;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t row = row_begin + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       row < end; row += threads) {
    const int32_t pair = row_pair[row];
    if (pair < 0) continue;  // padding: no gradient, its partials never written
    float dot = 0.0f;
    for (int32_t tile = 0; tile < column_tiles; ++tile)
      dot += partials[tile * partial_rows + (row - row_begin)];
    store_router_weight_grad(out, pair, dot);
  }
  if (out.d_router_weights_peers != nullptr) __threadfence_system();  // as the pass above
}

}  // namespace

cudaError_t launch_router_weight_grad_sum(const ScheduleHeader* header, const float* partials,
                                          int64_t partial_rows, const int32_t* row_pair,
                                          int64_t intermediate, float* d_router_weights,
                                          float* const* d_router_weights_peers,
                                          int32_t pairs_per_rank, KernelStream on,
                                          int64_t row_begin, int64_t row_count) {
  if (header == nullptr || partials == nullptr || row_pair == nullptr || partial_rows <= 0 ||
      row_begin < 0 || row_count < 0 || intermediate <= 0)
    return cudaErrorInvalidValue;
  if (d_router_weights == nullptr && d_router_weights_peers == nullptr) return cudaSuccess;
  const int sm_count = current_sm_count();
  SwigluBackwardArgs out{};
  out.d_router_weights = d_router_weights;
  out.d_router_weights_peers = d_router_weights_peers;
  out.pairs_per_rank = pairs_per_rank;
  const int32_t column_tiles = static_cast<int32_t>((intermediate + 255) / 256);
  return launch_maybe_overlapped(router_weight_grad_sum_kernel, sm_count * 2, 256, 0, on, 1, header,
                                 partials, partial_rows, row_pair, column_tiles, out, row_begin,
                                 row_count);
}

cudaError_t launch_swiglu_backward(const ScheduleHeader* header, int64_t num_rows, const void* gate,
                                   const void* up, const void* dh_raw, const int32_t* row_pair,
                                   const float* router_weights, int64_t intermediate, float limit,
                                   void* d_gate, void* d_up, void* weighted_hidden,
                                   float* d_router_weights, float* const* d_router_weights_peers,
                                   int32_t pairs_per_rank, KernelStream on, int64_t row_begin,
                                   int64_t row_count) {
  if (header == nullptr && num_rows == 0) return cudaSuccess;
  if (row_begin < 0 || row_count < 0) return cudaErrorInvalidValue;
  const int sm_count = current_sm_count();
  const SwigluBackwardArgs args = make_swiglu_backward_args(
      gate, up, dh_raw, row_pair, router_weights, intermediate, limit, d_gate, d_up,
      weighted_hidden, d_router_weights, d_router_weights_peers, pairs_per_rank, row_begin);
  return launch_maybe_overlapped(swiglu_backward_kernel, sm_count * 8, 256, 0, on, 1, args, header,
                                 num_rows, row_count);
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("swiglu_backward.cu",
                                 {kernel_symbol(&swiglu_backward_kernel),
                                  kernel_symbol(&router_weight_grad_sum_kernel)});
}  // namespace

}  // namespace mok::kernels
