// TensorView: a non-owning view of a tensor, field for field what DLPack's DLTensor carries
// (data pointer, device, dtype, shape, strides in elements), so the Python layer maps a
// DLPack capsule onto it without copying and C++ callers can wrap their own buffers.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "mok/dtype.h"

namespace mok {

// Values equal DLPack's DLDeviceType codes.
enum class DeviceType : int32_t {
  kCPU = 1,
  kCUDA = 2,
};

const char* device_type_name(DeviceType device_type);

struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int32_t ndim = 0;  // 0 = absent (an optional tensor that was not given)
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements, as DLPack
  DeviceType device_type = DeviceType::kCPU;
  int32_t device_id = 0;

  // A row-major contiguous view.
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape,
                               DeviceType device_type = DeviceType::kCPU, int32_t device_id = 0);
  static TensorView contiguous(void* data, DType dtype, const std::vector<int64_t>& shape,
                               DeviceType device_type = DeviceType::kCPU, int32_t device_id = 0);

  bool present() const { return ndim > 0; }
  int64_t numel() const;
  int64_t nbytes() const { return numel() * dtype_size(dtype); }
  bool is_contiguous() const;  // row-major, dense; dimensions of size 1 may have any stride
  // Row-major and dense below the first dimension, whose stride may be larger: every expert's
  // matrix of a view into a larger tensor (the gate half of a fused [E, 2I, H] gate/up weight,
  // torch's `gate_up[:, :I]`). Contiguous tensors are outer-strided.
  bool is_outer_strided() const;
  // Elements from one index of the first dimension to the next (the dense extent when the first
  // dimension has one index).
  int64_t outer_stride() const;
  std::string shape_string() const;  // e.g. "[8, 128, 256]"

  template <typename T>
  T* data_as() const {
    return static_cast<T*>(data);
  }
};

}  // namespace mok
