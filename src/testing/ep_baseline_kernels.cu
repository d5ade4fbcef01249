// Kernels of the expert-parallel baseline (src/testing/ep_baseline.cpp): what a user's all-to-all
// MoE layer runs around NCCL — bucketing (token, k) pairs by destination rank, gathering rows
// and routing metadata into send order, and scattering results back by pair.
//
// Bucketing: one CTA per destination rank r walks all pairs in chunks of its threads, in pair
// order; a pair's place inside bucket r is the count of earlier pairs of r (warp ballots and a
// per-chunk scan of warp counts), so buckets are stable and the result deterministic.
#include <cuda_runtime.h>

#include "kernels/comm/row_copy.cuh"
#include "kernels/common/kernel_preload.h"
#include "testing/baseline_kernels.h"

namespace mok::kernels {

namespace {

constexpr int kBucketThreads = 1024;

template <typename ExpertId>
__global__ void bucket_pairs_kernel(const ExpertId* top_experts, int32_t pairs,
                                    int32_t experts_per_rank, int32_t num_experts, int32_t* counts,
                                    int32_t* perm, int32_t* pos) {
  __shared__ int32_t warp_counts[kBucketThreads / 32];
  __shared__ int32_t chunk_total;
  const int32_t bucket = static_cast<int32_t>(blockIdx.x);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t offset = 0;
  if (perm != nullptr)
    for (int32_t r = 0; r < bucket; ++r) offset += counts[r];
  int32_t running = 0;
  for (int32_t base = 0; base < pairs; base += blockDim.x) {
    const int32_t pair = base + static_cast<int32_t>(threadIdx.x);
    bool mine = false;
    if (pair < pairs) {
      const int64_t expert = static_cast<int64_t>(top_experts[pair]);
      mine = expert >= 0 && expert < num_experts && expert / experts_per_rank == bucket;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    if (threadIdx.x == 0) {
      int32_t sum = 0;
      for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) {
        const int32_t count = warp_counts[w];
        warp_counts[w] = sum;
        sum += count;
      }
      chunk_total = sum;
    }
    __syncthreads();
    if (mine && perm != nullptr) {
      const int32_t place =
          offset + running + warp_counts[warp] + __popc(ballot & ((1u << lane) - 1u));
      perm[place] = pair;
      pos[pair] = place;
    }
    running += chunk_total;
    __syncthreads();
  }
  if (perm == nullptr && threadIdx.x == 0) counts[bucket] = running;
}

__global__ void gather_pair_rows_kernel(const int32_t* perm, int32_t count, int32_t divisor,
                                        const uint4* source, int64_t vectors_per_row,
                                        uint4* destination) {
  const int warps_total = gridDim.x * blockDim.x / 32;
  for (int32_t j = (blockIdx.x * blockDim.x + threadIdx.x) / 32; j < count; j += warps_total)
    copy_row_warp(destination + static_cast<int64_t>(j) * vectors_per_row,
                  source + static_cast<int64_t>(perm[j] / divisor) * vectors_per_row,
                  vectors_per_row);
}

template <typename ExpertId>
__global__ void gather_pair_meta_kernel(const int32_t* perm, int32_t count,
                                        const ExpertId* top_experts, const float* weights,
                                        int32_t experts_per_rank, int32_t* local_expert,
                                        float* weight) {
  for (int32_t j = blockIdx.x * blockDim.x + threadIdx.x; j < count; j += gridDim.x * blockDim.x) {
    const int32_t pair = perm[j];
    local_expert[j] =
        static_cast<int32_t>(static_cast<int64_t>(top_experts[pair]) % experts_per_rank);
    weight[j] = weights[pair];
  }
}

__global__ void inner_routing_kernel(const int32_t* received_expert, int32_t received,
                                     int32_t capacity, int32_t* inner_top) {
  for (int32_t j = blockIdx.x * blockDim.x + threadIdx.x; j < capacity; j += gridDim.x * blockDim.x)
    inner_top[j] = j < received ? received_expert[j] : -1;
}

__global__ void scatter_by_pair_kernel(const int32_t* pos, int32_t pairs, const float* values,
                                       float* out) {
  for (int32_t p = blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += gridDim.x * blockDim.x)
    out[p] = pos[p] >= 0 ? values[pos[p]] : 0.0f;
}

int blocks_for(int64_t count) {
  return static_cast<int>(std::min<int64_t>((count + 255) / 256, 1024));
}

}  // namespace

cudaError_t launch_bucket_pairs(const void* top_experts, DType expert_dtype, int32_t pairs,
                                int32_t experts_per_rank, int32_t num_ranks, int32_t* counts,
                                int32_t* perm, int32_t* pos, cudaStream_t stream) {
  if (num_ranks < 1 || experts_per_rank < 1) return cudaErrorInvalidValue;
  const int32_t num_experts = experts_per_rank * num_ranks;
  if (expert_dtype == DType::kInt64)
    bucket_pairs_kernel<<<num_ranks, kBucketThreads, 0, stream>>>(
        static_cast<const int64_t*>(top_experts), pairs, experts_per_rank, num_experts, counts,
        perm, pos);
  else
    bucket_pairs_kernel<<<num_ranks, kBucketThreads, 0, stream>>>(
        static_cast<const int32_t*>(top_experts), pairs, experts_per_rank, num_experts, counts,
        perm, pos);
  return cudaGetLastError();
}

cudaError_t launch_gather_pair_rows(const int32_t* perm, int32_t count, int32_t divisor,
                                    const void* source, int64_t hidden, void* destination,
                                    cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  gather_pair_rows_kernel<<<std::min(1024, (count + 7) / 8), 256, 0, stream>>>(
      perm, count, divisor, static_cast<const uint4*>(source), hidden / 8,
      static_cast<uint4*>(destination));
  return cudaGetLastError();
}

cudaError_t launch_gather_pair_meta(const int32_t* perm, int32_t count, const void* top_experts,
                                    DType expert_dtype, const float* weights,
                                    int32_t experts_per_rank, int32_t* local_expert, float* weight,
                                    cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (expert_dtype == DType::kInt64)
    gather_pair_meta_kernel<<<blocks_for(count), 256, 0, stream>>>(
        perm, count, static_cast<const int64_t*>(top_experts), weights, experts_per_rank,
        local_expert, weight);
  else
    gather_pair_meta_kernel<<<blocks_for(count), 256, 0, stream>>>(
        perm, count, static_cast<const int32_t*>(top_experts), weights, experts_per_rank,
        local_expert, weight);
  return cudaGetLastError();
}

cudaError_t launch_inner_routing(const int32_t* received_expert, int32_t received, int32_t capacity,
                                 int32_t* inner_top, cudaStream_t stream) {
  if (capacity == 0) return cudaSuccess;
  inner_routing_kernel<<<blocks_for(capacity), 256, 0, stream>>>(received_expert, received,
                                                                 capacity, inner_top);
  return cudaGetLastError();
}

cudaError_t launch_scatter_by_pair(const int32_t* pos, int32_t pairs, const float* values,
                                   float* out, cudaStream_t stream) {
  if (pairs == 0) return cudaSuccess;
  scatter_by_pair_kernel<<<blocks_for(pairs), 256, 0, stream>>>(pos, pairs, values, out);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload(
    "ep_baseline.cu",
    {kernel_symbol(&bucket_pairs_kernel<int32_t>), kernel_symbol(&bucket_pairs_kernel<int64_t>),
     kernel_symbol(&gather_pair_rows_kernel), kernel_symbol(&gather_pair_meta_kernel<int32_t>),
     kernel_symbol(&gather_pair_meta_kernel<int64_t>), kernel_symbol(&inner_routing_kernel),
     kernel_symbol(&scatter_by_pair_kernel)});
}  // namespace

}  // namespace mok::kernels
