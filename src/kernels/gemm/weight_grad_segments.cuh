// The rows each expert's weight gradient reduces, shared by the weight-gradient kernels
// (expert_gemm.cu's kWeightGrad form and weight_grad_pingpong.cu): [begin, end) of the schedule's
// rows, the expert's segment, or with skip_padding its routed rows rounded up to BLOCK_K (the
// rows past them are zero padding in both operands, so the bits are the same; the reference has
// no padding rows at all). Each CTA copies them into shared memory once when they fit, since a
// tile's K-blocks depend on them and both the producer and the consumers compute every tile's
// coordinates: a global load there sat between two tiles' mainloops.
#pragma once

#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_mainloop.cuh"

namespace mok::kernels {

struct SegmentRows {
  int begin;
  int end;
};

__device__ __forceinline__ SegmentRows segment_rows_of(const ExpertGemmParams& params, int e) {
  const int begin = params.expert_offsets[e];
  if (!params.skip_padding) return {begin, params.expert_offsets[e + 1]};
  return {begin, begin + (params.expert_counts[e] + BLOCK_K - 1) / BLOCK_K * BLOCK_K};
}

constexpr int kMaxSharedExperts = 1024;  // E_loc entries of two int32 (8 KB)

__host__ __device__ constexpr bool segments_in_shared(int num_experts) {
  return num_experts <= kMaxSharedExperts;
}

// Fills `rows` (shared memory, num_experts entries) when they fit and returns it, else null;
// the caller's barrier makes the copy visible.
__device__ __forceinline__ const SegmentRows* copy_segment_rows(const ExpertGemmParams& params,
                                                                SegmentRows* rows) {
  if (!segments_in_shared(params.num_experts)) return nullptr;
  for (int e = threadIdx.x; e < params.num_experts; e += blockDim.x)
    rows[e] = segment_rows_of(params, e);
  return rows;
}

__device__ __forceinline__ SegmentRows segment_rows(const ExpertGemmParams& params,
                                                    const SegmentRows* shared_rows, int e) {
  return shared_rows != nullptr ? shared_rows[e] : segment_rows_of(params, e);
}

}  // namespace mok::kernels
