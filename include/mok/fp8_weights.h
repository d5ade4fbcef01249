// Pre-quantized FP8 weights (ForwardArgs::w_*_fp8) from bf16 ones, in mok's own layout, for a
// caller that keeps FP8 weights itself (e.g. across the micro-batches of one optimizer step, or
// as the copy it ships): the codes and scales the layer computes from the same bf16 weight.
#pragma once

#include <cuda_runtime_api.h>

#include "mok/error.h"
#include "mok/tensor.h"

namespace mok {

// `weight` bf16 [E, n, k] (an expert-strided view allowed) or [n, k], n and k multiples of 128,
// into `codes` e4m3 of its shape and `scales` fp32 [E, n/128, k/128] (or [n/128, k/128]), both
// contiguous, on the weight's device: CPU tensors through the host quantizer (mok/fp8.h),
// CUDA tensors on `stream` (no synchronization) through the GPU's, with the same bits.
Status quantize_weight_fp8(const TensorView& weight, const TensorView& codes,
                           const TensorView& scales, cudaStream_t stream = nullptr);

}  // namespace mok
