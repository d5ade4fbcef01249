// The host runtime's two CUDA helpers: a checked call that names what failed, and an owning
// device allocation. Used by every host file that touches device memory.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "mok/error.h"

namespace mok {

// Throws mok::Error (kOutOfMemory for a failed allocation, else kCudaError) naming `what`.
inline void cuda_check(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess)
    throw Error(
        status == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory : ErrorCode::kCudaError,
        what + ": " + cudaGetErrorString(status));
}

// Device memory owned by one object; `bytes` is what was asked for (at least 16 are allocated,
// so an empty tensor still has a valid, aligned pointer).
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(int64_t size, const std::string& what) { allocate(size, what); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() {
    if (pointer != nullptr) cudaFree(pointer);
  }

  void allocate(int64_t size, const std::string& what) {
    if (pointer != nullptr) cudaFree(pointer);
    pointer = nullptr;
    bytes = size;
    cuda_check(cudaMalloc(&pointer, static_cast<size_t>(std::max<int64_t>(size, 16))),
               "cudaMalloc of " + what);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(pointer);
  }

  void* pointer = nullptr;
  int64_t bytes = 0;
};

}  // namespace mok
