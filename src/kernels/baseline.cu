// Kernels of the unfused baseline (src/baseline_layer.cpp): the elementwise steps a PyTorch
// user's MoE layer runs between its grouped GEMMs. Plain grid-stride loops, 16-byte accesses.
#include <cuda_bf16.h>

#include "kernels/launchers.h"
#include "kernels/swiglu.cuh"

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

// out[t] = bf16(shared[t] + sum_k fmaf(w[t,k], y[pair_row[t*K+k]])): the unpermute and
// weighted sum, reading each expert output row where the grouped GEMM left it.
__global__ void baseline_unpermute_kernel(const uint4* expert_rows, const int32_t* pair_row,
                                          const uint4* shared, const float* router_weights,
                                          int64_t num_tokens, int64_t vectors_per_row,
                                          int32_t top_k, uint4* out) {
  const int64_t total = num_tokens * vectors_per_row;
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < total;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t token = index / vectors_per_row, vector = index % vectors_per_row;
    float acc[8] = {};
    if (shared != nullptr) {
      const uint4 packed = shared[index];
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        acc[2 * p] = __low2float(pairs[p]);
        acc[2 * p + 1] = __high2float(pairs[p]);
      }
    }
    for (int k = 0; k < top_k; ++k) {
      const int row = pair_row[token * top_k + k];
      if (row < 0) continue;
      const float weight = router_weights != nullptr ? router_weights[token * top_k + k] : 1.0f;
      const uint4 packed = expert_rows[row * vectors_per_row + vector];
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        acc[2 * p] = fmaf(weight, __low2float(pairs[p]), acc[2 * p]);
        acc[2 * p + 1] = fmaf(weight, __high2float(pairs[p]), acc[2 * p + 1]);
      }
    }
    uint4 result;
    __nv_bfloat162* result_pairs = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
    for (int p = 0; p < 4; ++p) result_pairs[p] = __floats2bfloat162_rn(acc[2 * p], acc[2 * p + 1]);
    out[index] = result;
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

cudaError_t launch_baseline_unpermute(const void* expert_rows, const int32_t* pair_row,
                                      const void* shared, const float* router_weights,
                                      int64_t num_tokens, int64_t hidden, int32_t top_k, void* out,
                                      cudaStream_t stream) {
  if (num_tokens == 0) return cudaSuccess;
  const int64_t vectors_per_row = hidden / 8;
  baseline_unpermute_kernel<<<grid_for(num_tokens * vectors_per_row), 256, 0, stream>>>(
      static_cast<const uint4*>(expert_rows), pair_row, static_cast<const uint4*>(shared),
      router_weights, num_tokens, vectors_per_row, top_k, static_cast<uint4*>(out));
  return cudaGetLastError();
}

}  // namespace mok::kernels
