// Where a launcher's kernel runs: its stream, and whether the launch may overlap the previous
// kernel there (programmatic dependent launch, overlapped_launch.h; MoeConfig::
// overlap_kernel_launches). Overlapped, the kernel's CTAs are scheduled while that kernel
// finishes and wait for it before they touch memory: the same results as plain stream order,
// less launch latency between the two. Built implicitly from a stream (not overlapped), so a
// launcher's callers that do not overlap pass the stream as before. Also the current device's
// SM count, which the launchers of grids sized per SM ask for. Plain host C++.
#pragma once

#include <cuda_runtime_api.h>

namespace mok::kernels {

struct KernelStream {
  cudaStream_t stream;
  bool overlap;
  KernelStream(cudaStream_t stream_, bool overlap_ = false)  // NOLINT: implicit by design
      : stream(stream_), overlap(overlap_) {}
};

// SMs of the current device (0 if the runtime cannot say).
inline int current_sm_count() {
  int device = 0, sm_count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  return sm_count;
}

}  // namespace mok::kernels
