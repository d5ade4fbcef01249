// MOK_GEMM_ABLATION, the GEMM kernels' measurement switch (kernels/gemm/gemm_ablation.h):
// unset, "" or "none"; "no-loads"; "no-math".
#pragma once

#include "kernels/gemm/gemm_ablation.h"

namespace mok {

// The ablation a value names; throws Error(kInvalidArgument) naming the value and the valid ones.
kernels::GemmAblation parse_gemm_ablation(const char* value);

// The environment's MOK_GEMM_ABLATION, read once per process.
kernels::GemmAblation gemm_ablation_from_env();

}  // namespace mok
