// What the benchmark fixtures (stream_bench.cu, walk_bench.cu, l2_probe.cu) ask of the device:
// its SM count, and CUDA-event timing of work enqueued on the default stream.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <vector>

#include "layer/cuda_buffer.h"

namespace mok {

// The current device's SM count.
inline int current_sm_count() {
  int device = 0, sms = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute(multiProcessorCount)");
  return sms;
}

// Median ms of `passes` timed runs of `body`, after `warm_up` untimed ones.
template <typename Body>
double median_event_ms(Body body, int passes, int warm_up = 1) {
  cudaEvent_t start, stop;
  cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < warm_up; ++i) body();
  std::vector<float> times;
  for (int i = 0; i < passes; ++i) {
    cuda_check(cudaEventRecord(start), "cudaEventRecord");
    body();
    cuda_check(cudaEventRecord(stop), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(stop), "benchmark timing");
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace mok
