// Kernels of the baselines mok is measured against (baseline_kernels.cu, ep_baseline_kernels.cu):
// the unfused layer's SwiGLU and the expert-parallel baseline's bucketing and row moves.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mok/dtype.h"

namespace mok::kernels {

// The expert-parallel baseline's kernels (ep_baseline.cu). Bucketing of (token, k) pairs by
// destination rank (expert / experts_per_rank; ids outside [0, E) go nowhere): with perm null it
// writes counts[r]; with perm set (and counts from the first call) it writes perm (pairs in
// bucket order, stable) and pos[pair] = its place (pos must be -1-filled before).
cudaError_t launch_bucket_pairs(const void* top_experts, DType expert_dtype, int32_t pairs,
                                int32_t experts_per_rank, int32_t num_ranks, int32_t* counts,
                                int32_t* perm, int32_t* pos, cudaStream_t stream);
// destination[j] = source row perm[j] / divisor, for j < count.
cudaError_t launch_gather_pair_rows(const int32_t* perm, int32_t count, int32_t divisor,
                                    const void* source, int64_t hidden, void* destination,
                                    cudaStream_t stream);
// local_expert[j] = top_experts[perm[j]] % experts_per_rank, weight[j] = weights[perm[j]].
cudaError_t launch_gather_pair_meta(const int32_t* perm, int32_t count, const void* top_experts,
                                    DType expert_dtype, const float* weights,
                                    int32_t experts_per_rank, int32_t* local_expert, float* weight,
                                    cudaStream_t stream);
// inner_top[j] = received_expert[j] below `received`, else -1, for j < capacity.
cudaError_t launch_inner_routing(const int32_t* received_expert, int32_t received, int32_t capacity,
                                 int32_t* inner_top, cudaStream_t stream);
// out[p] = values[pos[p]] where pos[p] >= 0, else 0.
cudaError_t launch_scatter_by_pair(const int32_t* pos, int32_t pairs, const float* values,
                                   float* out, cudaStream_t stream);

// Unfused baseline (baseline.cu): SwiGLU over rows [0, num_rows) of [rows, I] buffers. (Its
// unpermute is launch_combine over its own permutation's pair_row.)
cudaError_t launch_baseline_swiglu(int64_t num_rows, const void* gate, const void* up,
                                   int64_t intermediate, float limit, void* hidden,
                                   cudaStream_t stream);

}  // namespace mok::kernels
