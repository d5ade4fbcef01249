// The host runtime's CUDA helpers: a checked call that names what failed, an owning device
// allocation, and a scoped switch of the current device (for code driving several GPUs). Used
// by every host file that touches device memory.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "mok/error.h"

namespace mok {

// Throws mok::Error (kOutOfMemory for a failed allocation, else kCudaError) naming `what`.
inline void cuda_check(cudaError_t status, const std::string& what) {
  if (status != cudaSuccess) {
    // A failed call that returned its error (a launch refused for its shared memory, say) also
    // leaves it as the runtime's last error; clear it, or the next launch check reports it as
    // its own. A sticky error stays whatever this does.
    (void)cudaGetLastError();
    throw Error(
        status == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory : ErrorCode::kCudaError,
        what + ": " + cudaGetErrorString(status));
  }
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

// Makes `device` current for the lifetime of the object, then restores the previous one.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cuda_check(cudaGetDevice(&previous_), "cudaGetDevice");
    cuda_check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace mok
