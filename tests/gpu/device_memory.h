// What the GPU tests of raw kernels share: a CUDA error check that throws with the call's text,
// and one owned device allocation.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <stdexcept>
#include <string>

namespace mok::test {

inline void cuda_check(cudaError_t error, const char* what) {
  if (error != cudaSuccess)
    throw std::runtime_error(std::string(what) + " failed: " + cudaGetErrorString(error));
}
#define CUDA_CHECK(expr) ::mok::test::cuda_check((expr), #expr)

// Owns one device allocation (none for zero bytes: get() is null).
class DeviceMemory {
 public:
  explicit DeviceMemory(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) CUDA_CHECK(cudaMalloc(&data_, bytes));
  }
  ~DeviceMemory() {
    if (data_ != nullptr) cudaFree(data_);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  void* get() const { return data_; }
  size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace mok::test
