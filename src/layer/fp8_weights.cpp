// quantize_weight_fp8 (mok/fp8_weights.h): the host quantizer for CPU tensors, the GPU's block
// quantizer (kernels/stages/fp8_quantize.h) for CUDA ones.
#include "mok/fp8_weights.h"

#include <string>

#include "kernels/stages/fp8_quantize.h"
#include "mok/fp8.h"

namespace mok {

namespace {

Status fail(const char* name, const std::string& what) {
  return Status::invalid(std::string("quantize_weight_fp8: argument `") + name + "` " + what);
}

bool same_shape(const TensorView& view, const int64_t* dims, int ndim) {
  if (view.ndim != ndim) return false;
  for (int d = 0; d < ndim; ++d)
    if (view.shape[d] != dims[d]) return false;
  return true;
}

}  // namespace

Status quantize_weight_fp8(const TensorView& weight, const TensorView& codes,
                           const TensorView& scales, cudaStream_t stream) {
  if (!weight.present() || (weight.ndim != 2 && weight.ndim != 3))
    return fail("weight", "has shape " + weight.shape_string() + "; expected [E, n, k] or [n, k]");
  if (weight.dtype != DType::kBFloat16)
    return fail("weight", std::string("has dtype ") + dtype_name(weight.dtype) + "; expected bf16");
  if (!weight.is_outer_strided())
    return fail("weight", "is not row-major within each expert; pass a contiguous tensor");
  const int ndim = weight.ndim;
  const int64_t experts = ndim == 3 ? weight.shape[0] : 1;
  const int64_t rows = weight.shape[ndim - 2], cols = weight.shape[ndim - 1];
  if (rows % kFp8GroupSize != 0 || cols % kFp8GroupSize != 0)
    return fail("weight", "has shape " + weight.shape_string() +
                              "; its last two extents must be multiples of 128 (the FP8 blocks)");
  int64_t scale_dims[3] = {experts, rows / kFp8GroupSize, cols / kFp8GroupSize};
  const int64_t* block_dims = ndim == 3 ? scale_dims : scale_dims + 1;
  if (codes.dtype != DType::kFloat8E4M3 || !same_shape(codes, weight.shape, ndim) ||
      !codes.is_contiguous())
    return fail("codes", "is " + std::string(dtype_name(codes.dtype)) + " " + codes.shape_string() +
                             "; expected contiguous fp8_e4m3 " + weight.shape_string());
  if (scales.dtype != DType::kFloat32 || !same_shape(scales, block_dims, ndim) ||
      !scales.is_contiguous())
    return fail("scales", "is " + std::string(dtype_name(scales.dtype)) + " " +
                              scales.shape_string() + "; expected contiguous fp32 with one scale " +
                              "per 128 x 128 block");
  for (const TensorView* view : {&codes, &scales})
    if (view->device_type != weight.device_type || view->device_id != weight.device_id)
      return fail(view == &codes ? "codes" : "scales", "is not on the weight's device");
  const int64_t values = rows * cols, blocks = values / (kFp8GroupSize * kFp8GroupSize);
  if (weight.device_type == DeviceType::kCPU) {
    for (int64_t e = 0; e < experts; ++e)
      quantize_fp8_blocks(weight.data_as<const bf16>() + e * weight.outer_stride(), rows, cols,
                          codes.data_as<e4m3>() + e * values, scales.data_as<float>() + e * blocks);
    return Status::Ok();
  }
  kernels::Fp8QuantizeBatch batch;
  batch.count = experts;
  batch.in_stride = ndim == 3 ? weight.outer_stride() : 0;
  const cudaError_t status =
      kernels::launch_quantize_fp8(weight.data, rows, cols, kernels::Fp8QuantizeForm::kBlocks,
                                   codes.data, scales.data_as<float>(), stream, batch);
  if (status != cudaSuccess)
    return Status{ErrorCode::kCudaError,
                  std::string("quantize_weight_fp8: ") + cudaGetErrorString(status)};
  return Status::Ok();
}

}  // namespace mok
