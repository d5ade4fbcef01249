// Combine: the fixed-order sum at the source rank. For each token, the shared expert's output
// (if any) and then its K routed expert output rows, weighted by the router weights with fmaf,
// in k order, summed in fp32 and rounded once to bf16 (docs/design.md). The expert GEMM left
// its output rows in schedule order; pair t*K + k reads row index[t*K + k] (-1: the slot is
// not routed, it adds nothing). The expert-parallel combine reads its pushed rows from the slots
// and its own experts' rows from `local_rows`, coded as index <= -2 (stages/launch.h).
//
// Roles: one thread per (token, 8 columns): 16-byte loads of each row, 8 fp32 accumulators.
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/stages/launch.h"

namespace mok::kernels {

namespace {

__global__ void combine_kernel(const uint4* expert_rows, const int32_t* row_index,
                               const uint4* local_rows, const uint4* shared,
                               const float* router_weights, int64_t num_tokens,
                               int64_t vectors_per_row, int32_t top_k, uint4* out) {
  const int64_t total = num_tokens * vectors_per_row;
  for (int64_t index = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; index < total;
       index += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t token = index / vectors_per_row, vector = index % vectors_per_row;
    float acc[8];
    if (shared != nullptr) {
      const uint4 packed = shared[index];
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const float2 value = __bfloat1622float2(pairs[p]);
        acc[2 * p] = value.x;
        acc[2 * p + 1] = value.y;
      }
    } else {
#pragma unroll
      for (int c = 0; c < 8; ++c) acc[c] = 0.0f;
    }
    for (int k = 0; k < top_k; ++k) {
      const int32_t row = row_index[token * top_k + k];
      if (row == -1) continue;
      const float weight = router_weights != nullptr ? router_weights[token * top_k + k] : 1.0f;
      const uint4 packed =
          row >= 0 ? expert_rows[row * vectors_per_row + vector]
                   : local_rows[(-2 - static_cast<int64_t>(row)) * vectors_per_row + vector];
      const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const float2 value = __bfloat1622float2(pairs[p]);
        acc[2 * p] = fmaf(weight, value.x, acc[2 * p]);
        acc[2 * p + 1] = fmaf(weight, value.y, acc[2 * p + 1]);
      }
    }
    uint4 result;
    __nv_bfloat162* result_pairs = reinterpret_cast<__nv_bfloat162*>(&result);
#pragma unroll
    for (int p = 0; p < 4; ++p) result_pairs[p] = __floats2bfloat162_rn(acc[2 * p], acc[2 * p + 1]);
    out[index] = result;
  }
}

}  // namespace

cudaError_t launch_combine(const void* expert_rows, const int32_t* index, const void* shared,
                           const float* router_weights, int64_t num_tokens, int64_t hidden,
                           int32_t top_k, void* out, cudaStream_t stream, const void* local_rows) {
  if (num_tokens == 0) return cudaSuccess;
  const int64_t vectors_per_row = hidden / 8;
  const int64_t total = num_tokens * vectors_per_row;
  const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 132 * 16));
  combine_kernel<<<blocks, 256, 0, stream>>>(
      static_cast<const uint4*>(expert_rows), index, static_cast<const uint4*>(local_rows),
      static_cast<const uint4*>(shared), router_weights, num_tokens, vectors_per_row, top_k,
      static_cast<uint4*>(out));
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("combine.cu", {kernel_symbol(&combine_kernel)});
}  // namespace

}  // namespace mok::kernels
