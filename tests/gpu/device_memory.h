// What the GPU tests of raw kernels share: a CUDA error check that throws with the call's text,
// one owned device allocation, a set of them freed together (DeviceAllocations), a host vector
// copied into one of the set (upload), and a timing's start and stop events (TimingEvents).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <deque>
#include <stdexcept>
#include <string>
#include <vector>

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

// Owns a problem's device allocations, freed together with it.
class DeviceAllocations {
 public:
  template <typename T = void>
  T* allocate(size_t bytes) {
    return static_cast<T*>(owned_.emplace_back(bytes).get());
  }

 private:
  std::deque<DeviceMemory> owned_;  // a deque: DeviceMemory does not move
};

// `values` copied into a device allocation that `memory` owns.
template <typename T>
T* upload(DeviceAllocations& memory, const std::vector<T>& values) {
  T* device = memory.allocate<T>(values.size() * sizeof(T));
  CUDA_CHECK(cudaMemcpy(device, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
  return device;
}

// A timing's start and stop events, destroyed even when an ASSERT returns early.
struct TimingEvents {
  cudaEvent_t start = nullptr, stop = nullptr;
  TimingEvents() {
    CUDA_CHECK(cudaEventCreate(&start));
    const cudaError_t created = cudaEventCreate(&stop);
    if (created != cudaSuccess) cudaEventDestroy(start);  // the destructor won't run on a throw
    CUDA_CHECK(created);
  }
  ~TimingEvents() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
  }
  TimingEvents(const TimingEvents&) = delete;
  TimingEvents& operator=(const TimingEvents&) = delete;
};

}  // namespace mok::test
