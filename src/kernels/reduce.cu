// The router-weight gradient's last step: each pair's per-tile partial sums of <dh_raw, h>
// (written by the kDownGradSwiGLU epilogue) added in tile order, one thread per pair, so the
// result has one producer and a fixed order.
#include "kernels/launchers.h"

namespace mok::kernels {

namespace {

__global__ void router_weight_grad_kernel(const int32_t* pair_row, const float* rw_partial, int32_t num_n_tiles,
                                          int64_t num_pairs, float* d_router_weights) {
  for (int64_t pair = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; pair < num_pairs;
       pair += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int row = pair_row[pair];
    float sum = 0.0f;
    if (row >= 0)
      for (int n = 0; n < num_n_tiles; ++n) sum += rw_partial[static_cast<int64_t>(row) * num_n_tiles + n];
    d_router_weights[pair] = sum;
  }
}

}  // namespace

cudaError_t launch_router_weight_grad(const int32_t* pair_row, const float* rw_partial, int32_t num_n_tiles,
                                      int64_t num_pairs, float* d_router_weights, cudaStream_t stream) {
  if (num_pairs == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>((num_pairs + 255) / 256, 1024));
  router_weight_grad_kernel<<<blocks, 256, 0, stream>>>(pair_row, rw_partial, num_n_tiles, num_pairs,
                                                        d_router_weights);
  return cudaGetLastError();
}

}  // namespace mok::kernels
