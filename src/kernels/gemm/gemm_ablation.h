// A profiling ablation of the GEMM kernels (expert_gemm.cu, fp8_gemm.cu), set by the
// environment variable MOK_GEMM_ABLATION (layer/gemm_ablation.h): one part of a tile's work
// left out, to time what the rest alone costs. The outputs are then meaningless; never set
// outside a measurement. Plain data, shared by the host and the kernels.
//   kNoLoads  the producer arms each stage with no bytes (no TMA loads): the consumers' wgmmas
//             and epilogues (and the bf16 gate/up GEMM's fused gather) on whatever the stages
//             hold
//   kNoMath   the consumers wait for and release each stage without their wgmmas: the loads
//             (and the gather) and the epilogues
//   kNoSwiglu the bf16 gate/up epilogue writes g as h instead of computing SwiGLU: what the
//             SwiGLU math costs the forward's gate/up GEMM (an upper bound on any faster SwiGLU)
#pragma once

#include <stdint.h>

namespace mok::kernels {

enum class GemmAblation : int32_t { kNone = 0, kNoLoads = 1, kNoMath = 2, kNoSwiglu = 3 };

}  // namespace mok::kernels
