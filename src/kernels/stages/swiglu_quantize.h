// The FP8 forward's SwiGLU (swiglu_quantize.cu; issue 17): h = bf16(swiglu(g, u)) from the bf16
// gate/up outputs, quantized for the FP8 down GEMM in the same pass, in 1 x 128 groups along I
// (mok/fp8.h), without writing h in bf16. Same h as the bf16 path's epilogue (swiglu.cuh), same
// codes and scales as quantizing that h with the row-group quantizer (fp8_quantize.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/kernel_stream.h"

namespace mok::kernels {

// gate, up: bf16 [rows, inter], inter a multiple of 128; limit: the SwiGLU clamp (infinity =
// none). h_codes: e4m3 [rows, inter]; h_scales: fp32 group-major [inter / 128, rows] (the FP8
// GEMM's A scales). cudaErrorInvalidValue for inter not a multiple of 128.
cudaError_t launch_swiglu_quantize_fp8(const void* gate, const void* up, int64_t rows,
                                       int64_t inter, float limit, void* h_codes, float* h_scales,
                                       KernelStream on);

}  // namespace mok::kernels
