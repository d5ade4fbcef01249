// Host-callable launchers of the device kernels (compiled by nvcc, called from the plain C++
// host runtime). Pointers are device memory; nothing here synchronizes.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "kernels/expert_gemm_params.h"
#include "mok/dtype.h"
#include "mok/schedule.h"

namespace mok::kernels {

// Expert grouped GEMM (expert_gemm.cu). tmap_b1 is used only by kGateUpSwiGLU.
size_t expert_gemm_smem_bytes();
cudaError_t launch_expert_gemm(ExpertGemmForm form, const CUtensorMap& tmap_a,
                               const CUtensorMap& tmap_b0, const CUtensorMap& tmap_b1,
                               const ExpertGemmParams& params, int num_ctas, cudaStream_t stream);

// Local dispatch (dispatch_local.cu): rows [0, header.total_rows) of `rows` [max_rows, hidden]
// get x[token of row_pair[row]]; padding rows get zeros. `top_k` decodes the pair index.
cudaError_t launch_gather_rows(const ScheduleHeader* header, const int32_t* row_pair,
                               const void* x, int64_t hidden, int32_t top_k, void* rows,
                               int64_t max_rows, cudaStream_t stream);

// Combine (combine.cu): out[t] = bf16(shared[t] + sum_k fmaf(w[t,k], slots[t*K + k])) over the
// slots whose expert id is in [0, num_experts), in k order. `shared` may be null.
cudaError_t launch_combine(const void* slots, const void* shared, const void* top_experts,
                           DType expert_dtype, const float* router_weights, int64_t num_tokens,
                           int64_t hidden, int32_t top_k, int64_t num_experts, void* out,
                           cudaStream_t stream);

// Unfused baseline (baseline.cu). SwiGLU over rows [0, num_rows) of [rows, I] buffers;
// unpermute: out[t] = bf16(shared[t] + sum_k fmaf(w[t,k], expert_rows[pair_row[t*K + k]])).
cudaError_t launch_baseline_swiglu(int64_t num_rows, const void* gate, const void* up, int64_t intermediate,
                                   float limit, void* hidden, cudaStream_t stream);
cudaError_t launch_baseline_unpermute(const void* expert_rows, const int32_t* pair_row, const void* shared,
                                      const float* router_weights, int64_t num_tokens, int64_t hidden,
                                      int32_t top_k, void* out, cudaStream_t stream);

}  // namespace mok::kernels
