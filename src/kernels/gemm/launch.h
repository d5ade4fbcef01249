// Host-callable launcher of the expert grouped GEMM (expert_gemm.cu), compiled by nvcc and called
// from the host runtime. Pointers are device memory; nothing here synchronizes.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/kernel_stream.h"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/wide_tile_walk.h"

namespace mok::kernels {

// Expert grouped GEMM (expert_gemm.cu): the tensor maps each form reads are listed at the top
// of expert_gemm.cu; unused maps may be any valid map.
struct ExpertGemmMaps {
  CUtensorMap a0, a1, b0, b1;
  // Outputs of the form (expert_gemm_params.h), 3-D maps with boxes of [128 rows x 64 columns]:
  // [1, rows, N] for the row forms, [E_loc, M, N] for kWeightGrad. out2/out3 only where the
  // form has them.
  CUtensorMap out, out2, out3;
};
// cta_pairs: clusters of two CTAs that multicast a shared B tile (expert_gemm.cu); num_ctas is
// then rounded down to the pairs that fit at once.
// kWeightGrad with params.weight_grad_pingpong, one macrobatch and no pairs runs
// launch_weight_grad_pingpong instead.
// `on`: a stream, or {stream, true} to overlap the launch with the previous kernel
// (kernels/common/kernel_stream.h; the kernel waits for it before touching memory). The ping-pong
// weight gradients launch plainly.
cudaError_t launch_expert_gemm(ExpertGemmForm form, const ExpertGemmMaps& maps,
                               const ExpertGemmParams& params, int num_ctas, bool cta_pairs,
                               KernelStream on);

// The weight gradients with the consumer warpgroups on different 128 x 128 tiles
// (weight_grad_pingpong.cu): reads a0 (A, [rows, M] MN-major), b0 (B, [rows, N] MN-major) and
// writes out ([E_loc, M, N]) as the kWeightGrad form does, one macrobatch (params.macrobatch.rows
// = 0). The same bits.
cudaError_t launch_weight_grad_pingpong(const ExpertGemmMaps& maps, const ExpertGemmParams& params,
                                        int num_ctas, cudaStream_t stream);

// The row-tile GEMMs in 256 x 192 tiles (wide_tile_gemm.cu; MoeConfig::gemm_wide_tiles):
// kGateUpSwiGLU (96 gate + 96 up columns), kDownStore, kDownGrad and kGateUpGradStore, reading
// and writing what launch_expert_gemm's forms do, with the same bits. A maps: K-major rows with
// [128 x 64] boxes (a1: d_u of kGateUpGradStore); B maps: the gate/up form's Wg (b0) and Wu
// (b1) K-major with [96 x 64] boxes, kDownStore's Wd K-major with [192 x 64] boxes, the
// dgrads' weights MN-major with [64 x 64] boxes (b1: Wu); out: [1, rows, N] with [128 x 64]
// boxes (the gate/up form writes `swiglu` instead). The gate/up form runs the fused local
// dispatch (params.gather) as launch_expert_gemm's does, without the expert-parallel pull. No
// push (params.push unset), one launch per macrobatch, params.num_experts at most
// kMaxWideTileExperts (mok/config.h); another form returns cudaErrorInvalidValue.
//
// The gate/up form's outputs, [rows, I] bf16 each at row - out_row_base (the forward's h and
// its context g and u), written with plain stores.
struct WideSwigluOutputs {
  __nv_bfloat16* h;
  __nv_bfloat16* gate;
  __nv_bfloat16* up;
};
struct WideGemmMaps {
  CUtensorMap a0, a1, b0, b1, out;
  WideSwigluOutputs swiglu;  // kGateUpSwiGLU only (out unused there)
};
cudaError_t launch_wide_tile_gemm(ExpertGemmForm form, const WideGemmMaps& maps,
                                  const ExpertGemmParams& params, int num_ctas,
                                  cudaStream_t stream);

}  // namespace mok::kernels
