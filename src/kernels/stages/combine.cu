// Combine: the fixed-order sum at the source rank. For each token, the shared expert's output
// (if any) and then its K routed expert output rows, weighted by the router weights with fmaf,
// in k order, summed in fp32 and rounded once to bf16 (docs/design.md). The expert GEMM left
// its output rows in schedule order; pair t*K + k reads row index[t*K + k] (-1: the slot is
// not routed, it adds nothing). The expert-parallel combine reads its pushed rows from the slots
// and its own experts' rows from `local_rows`, coded as index <= -2 (stages/launch.h).
//
// Roles: one thread per (token, 8 columns): 16-byte loads of each row, 8 fp32 accumulators. A
// thread reads up to kRowsInFlight routed rows' indices, then issues all their loads, then adds
// them in k order (one row at a time, each load waited for before the next, was 4% slower; the
// pass moves its bytes near the DRAM rate either way: docs/perf.md, session 38). The order of the
// sums, and so the bits, is the same.
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/common/overlapped_launch.h"
#include "kernels/common/ptx.cuh"
#include "kernels/stages/launch.h"

namespace mok::kernels {

namespace {

constexpr int kCombineThreads = 256;
constexpr int kRowsInFlight = 8;  // a top-8 token's rows in one round

__device__ __forceinline__ void add_row(float (&acc)[8], const uint4& packed, float weight) {
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const float2 value = __bfloat1622float2(pairs[p]);
    acc[2 * p] = fmaf(weight, value.x, acc[2 * p]);
    acc[2 * p + 1] = fmaf(weight, value.y, acc[2 * p + 1]);
  }
}

__global__ void __launch_bounds__(kCombineThreads)
    combine_kernel(const uint4* __restrict__ expert_rows, const int32_t* __restrict__ row_index,
                   const uint4* __restrict__ local_rows, const uint4* __restrict__ shared,
                   const float* __restrict__ router_weights, int64_t num_tokens,
                   int64_t vectors_per_row, int32_t top_k, uint4* __restrict__ out) {
  ptx::begin_after_previous_kernel();
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
    for (int k_base = 0; k_base < top_k; k_base += kRowsInFlight) {
      uint4 packed[kRowsInFlight];
      float weight[kRowsInFlight];
      bool routed[kRowsInFlight];
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u) {
        const int k = k_base + u;
        const int32_t row = k < top_k ? row_index[token * top_k + k] : -1;
        routed[u] = row != -1;  // -1: the slot adds nothing
        weight[u] = 1.0f;
        packed[u] = make_uint4(0, 0, 0, 0);
        if (!routed[u]) continue;
        if (router_weights != nullptr) weight[u] = router_weights[token * top_k + k];
        packed[u] = row >= 0
                        ? expert_rows[row * vectors_per_row + vector]
                        : local_rows[(-2 - static_cast<int64_t>(row)) * vectors_per_row + vector];
      }
#pragma unroll
      for (int u = 0; u < kRowsInFlight; ++u)
        if (routed[u]) add_row(acc, packed[u], weight[u]);
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
                           int32_t top_k, void* out, KernelStream on, const void* local_rows) {
  if (num_tokens == 0) return cudaSuccess;
  const int64_t vectors_per_row = hidden / 8;
  const int64_t total = num_tokens * vectors_per_row;
  const int blocks = static_cast<int>(
      std::min<int64_t>((total + kCombineThreads - 1) / kCombineThreads, 132 * 16));
  return launch_maybe_overlapped(
      combine_kernel, blocks, kCombineThreads, 0, on, 1, static_cast<const uint4*>(expert_rows),
      index, static_cast<const uint4*>(local_rows), static_cast<const uint4*>(shared),
      router_weights, num_tokens, vectors_per_row, top_k, static_cast<uint4*>(out));
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("combine.cu", {kernel_symbol(&combine_kernel)});
}  // namespace

}  // namespace mok::kernels
