// DLPack arrays to mok::TensorView (tensors.h).
#include "tensors.h"

#include <string>

#include "mok/error.h"

namespace mok::python {

namespace {

namespace dlpack = nanobind::dlpack;

std::string dtype_string(const dlpack::dtype& dtype) {
  return "(DLPack code " + std::to_string(dtype.code) + ", " + std::to_string(dtype.bits) +
         " bits, " + std::to_string(dtype.lanes) + " lanes)";
}

DType dtype_of(const dlpack::dtype& dtype, const char* name) {
  const auto code = static_cast<dlpack::dtype_code>(dtype.code);
  if (dtype.lanes == 1) {
    if (code == dlpack::dtype_code::Bfloat && dtype.bits == 16) return DType::kBFloat16;
    if (code == dlpack::dtype_code::Float && dtype.bits == 32) return DType::kFloat32;
    if (code == dlpack::dtype_code::Int && dtype.bits == 32) return DType::kInt32;
    if (code == dlpack::dtype_code::Int && dtype.bits == 64) return DType::kInt64;
    if (code == dlpack::dtype_code::Float8_E4M3FN && dtype.bits == 8) return DType::kFloat8E4M3;
  }
  throw Error(ErrorCode::kInvalidArgument,
              std::string("argument `") + name + "` has dtype " + dtype_string(dtype) +
                  "; mok takes bfloat16, float32, int32 or int64 tensors, and float8_e4m3fn "
                  "for pre-quantized weights");
}

}  // namespace

TensorView view_of(const Array& array, const char* name) {
  TensorView view;
  const size_t ndim = array.ndim();
  if (ndim == 0 || ndim > static_cast<size_t>(TensorView::kMaxDims))
    throw Error(ErrorCode::kInvalidArgument,
                std::string("argument `") + name + "` has " + std::to_string(ndim) +
                    " dimensions; mok's tensors have 1 to " + std::to_string(TensorView::kMaxDims));
  view.data = array.data();
  view.dtype = dtype_of(array.dtype(), name);
  view.ndim = static_cast<int32_t>(ndim);
  for (size_t i = 0; i < ndim; ++i) {
    view.shape[i] = static_cast<int64_t>(array.shape(i));
    view.strides[i] = static_cast<int64_t>(array.stride(i));
  }
  const int32_t device_type = array.device_type();
  if (device_type == nanobind::device::cpu::value) {
    view.device_type = DeviceType::kCPU;
  } else if (device_type == nanobind::device::cuda::value) {
    view.device_type = DeviceType::kCUDA;
  } else {
    throw Error(ErrorCode::kInvalidArgument,
                std::string("argument `") + name + "` is on DLPack device type " +
                    std::to_string(device_type) + "; mok takes CPU and CUDA tensors");
  }
  view.device_id = array.device_id();
  return view;
}

TensorView view_of(const std::optional<Array>& array, const char* name) {
  return array.has_value() ? view_of(*array, name) : TensorView{};
}

}  // namespace mok::python
