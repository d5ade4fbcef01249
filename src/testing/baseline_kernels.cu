// Kernels of the unfused baseline (src/baseline_layer.cpp): the elementwise steps a PyTorch
// user's MoE layer runs between its grouped GEMMs. Plain grid-stride loops, 16-byte accesses.
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/stages/swiglu.cuh"
#include "testing/baseline_kernels.h"

namespace mok::kernels {

namespace {

// h[r, i] = swiglu(gate[r, i], up[r, i]) for rows [0, num_rows), 8 columns per thread.
__global__ void baseline_swiglu_kernel(int64_t num_rows, const uint4* gate, const uint4* up,
                                       int64_t vectors_per_row, float limit, uint4* hidden) {
  const int64_t total = num_rows * vectors_per_row;
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < total;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 g = gate[index], u = up[index];
    const __nv_bfloat162* g2 = reinterpret_cast<const __nv_bfloat162*>(&g);
    const __nv_bfloat162* u2 = reinterpret_cast<const __nv_bfloat162*>(&u);
    uint4 result;
    __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const float2 gf = __bfloat1622float2(g2[p]), uf = __bfloat1622float2(u2[p]);
      h2[p] = __floats2bfloat162_rn(swiglu_forward(gf.x, uf.x, limit),
                                    swiglu_forward(gf.y, uf.y, limit));
    }
    hidden[index] = result;
  }
}

int grid_for(int64_t total) {
  return static_cast<int>(std::min<int64_t>((total + 255) / 256, 132 * 16));
}

}  // namespace

cudaError_t launch_baseline_swiglu(int64_t num_rows, const void* gate, const void* up,
                                   int64_t intermediate, float limit, void* hidden,
                                   cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  const int64_t vectors_per_row = intermediate / 8;
  baseline_swiglu_kernel<<<grid_for(num_rows * vectors_per_row), 256, 0, stream>>>(
      num_rows, static_cast<const uint4*>(gate), static_cast<const uint4*>(up), vectors_per_row,
      limit, static_cast<uint4*>(hidden));
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("baseline.cu", {kernel_symbol(&baseline_swiglu_kernel)});
}  // namespace

}  // namespace mok::kernels
