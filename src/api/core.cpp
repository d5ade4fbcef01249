// Names of the enums of the public API, and TensorView helpers.
#include <string>

#include "mok/config.h"
#include "mok/dtype.h"
#include "mok/error.h"
#include "mok/tensor.h"

namespace mok {

const char* error_code_name(ErrorCode code) {
  switch (code) {
    case ErrorCode::kOk:
      return "ok";
    case ErrorCode::kInvalidArgument:
      return "invalid argument";
    case ErrorCode::kUnsupported:
      return "unsupported";
    case ErrorCode::kOutOfMemory:
      return "out of memory";
    case ErrorCode::kCudaError:
      return "CUDA error";
    case ErrorCode::kDeviceFault:
      return "device fault";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kInternal:
      return "internal error";
    case ErrorCode::kCommError:
      return "communication error";
  }
  return "unknown error";
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return "bf16";
    case DType::kFloat32:
      return "fp32";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kFloat8E4M3:
      return "fp8_e4m3";
  }
  return "unknown";
}

const char* device_type_name(DeviceType device_type) {
  switch (device_type) {
    case DeviceType::kCPU:
      return "cpu";
    case DeviceType::kCUDA:
      return "cuda";
  }
  return "unknown";
}

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::kBF16:
      return "bf16";
    case Precision::kFP8Block:
      return "fp8_block";
  }
  return "unknown";
}

const char* local_dispatch_name(LocalDispatch dispatch) {
  switch (dispatch) {
    case LocalDispatch::kGatherKernel:
      return "gather-kernel";
    case LocalDispatch::kProducerWarps:
      return "producer-warps";
  }
  return "unknown";
}

const char* fp8_swiglu_place_name(Fp8SwigluPlace place) {
  switch (place) {
    case Fp8SwigluPlace::kPass:
      return "pass";
    case Fp8SwigluPlace::kGateUpWithoutContext:
      return "gate-up-without-context";
    case Fp8SwigluPlace::kGateUp:
      return "gate-up";
  }
  return "unknown";
}

Precision precision_from_name(const std::string& name) {
  for (const Precision precision : {Precision::kBF16, Precision::kFP8Block})
    if (name == precision_name(precision)) return precision;
  throw Error(ErrorCode::kInvalidArgument,
              "precision '" + name + "' is unknown; valid: bf16, fp8_block");
}

LocalDispatch local_dispatch_from_name(const std::string& name) {
  for (LocalDispatch mode : {LocalDispatch::kGatherKernel, LocalDispatch::kProducerWarps})
    if (name == local_dispatch_name(mode)) return mode;
  throw Error(ErrorCode::kInvalidArgument,
              "local dispatch '" + name + "' is unknown; valid: gather-kernel, producer-warps");
}

Fp8SwigluPlace fp8_swiglu_place_from_name(const std::string& name) {
  for (Fp8SwigluPlace place :
       {Fp8SwigluPlace::kPass, Fp8SwigluPlace::kGateUpWithoutContext, Fp8SwigluPlace::kGateUp})
    if (name == fp8_swiglu_place_name(place)) return place;
  throw Error(ErrorCode::kInvalidArgument, "fp8_swiglu '" + name +
                                               "' is unknown; valid: pass, "
                                               "gate-up-without-context, gate-up");
}

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                                  DeviceType device_type, int32_t device_id) {
  return contiguous(data, dtype, std::vector<int64_t>(shape), device_type, device_id);
}

TensorView TensorView::contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                                  DeviceType device_type, int32_t device_id) {
  if (shape.size() < 1 || shape.size() > static_cast<size_t>(kMaxDims))
    throw Error(ErrorCode::kInvalidArgument,
                "TensorView::contiguous: " + std::to_string(shape.size()) +
                    " dimensions given; valid: 1.." + std::to_string(kMaxDims));
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.ndim = static_cast<int32_t>(shape.size());
  view.device_type = device_type;
  view.device_id = device_id;
  int dim = 0;
  for (int64_t extent : shape) view.shape[dim++] = extent;
  int64_t stride = 1;
  for (int d = view.ndim - 1; d >= 0; --d) {
    view.strides[d] = stride;
    stride *= view.shape[d];
  }
  return view;
}

int64_t TensorView::numel() const {
  if (ndim == 0) return 0;
  int64_t count = 1;
  for (int d = 0; d < ndim; ++d) count *= shape[d];
  return count;
}

bool TensorView::is_contiguous() const {
  if (ndim > 0 && numel() == 0) return true;  // no element: every stride describes it
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

bool TensorView::is_outer_strided() const {
  if (ndim < 2 || numel() == 0) return is_contiguous();
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 1; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return shape[0] == 1 || strides[0] >= expected;
}

int64_t TensorView::outer_stride() const {
  if (ndim == 0) return 0;
  int64_t inner = 1;
  for (int d = 1; d < ndim; ++d) inner *= shape[d];
  return shape[0] > 1 ? strides[0] : inner;
}

std::string TensorView::shape_string() const {
  std::string text = "[";
  for (int d = 0; d < ndim; ++d) {
    if (d > 0) text += ", ";
    text += std::to_string(shape[d]);
  }
  return text + "]";
}

}  // namespace mok
