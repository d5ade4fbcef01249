// Keeps all but a few SMs busy for a while, for the tests that a persistent kernel finishes on
// the SMs left to it (its CTAs must not wait for CTAs that cannot become resident).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <stdint.h>

namespace mok::test {
namespace {  // one copy per test file that launches it

// One SM per block (launched with enough dynamic shared memory that no persistent CTA fits
// beside it), for `hold_ns`, then exits.
__global__ void hold_sms_kernel(uint64_t hold_ns) {
  extern __shared__ unsigned char hog[];
  uint64_t start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (threadIdx.x == 0) hog[now & 1023] = 1;
  } while (now - start < hold_ns);
}

// Holds every SM of the current device but `free_sms` for `hold_ns`, on a stream of its own;
// still_held() says whether it still does. The destructor waits for the hold to end.
class SmHold {
 public:
  SmHold(int free_sms, uint64_t hold_ns) {
    int device = 0, sm_count = 0;
    EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
    EXPECT_EQ(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device),
              cudaSuccess);
    constexpr int kSharedBytes = 120 * 1024;
    EXPECT_EQ(cudaFuncSetAttribute(hold_sms_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                   kSharedBytes),
              cudaSuccess);
    EXPECT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    EXPECT_EQ(cudaEventCreate(&done_), cudaSuccess);
    hold_sms_kernel<<<sm_count - free_sms, 128, kSharedBytes, stream_>>>(hold_ns);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_EQ(cudaEventRecord(done_, stream_), cudaSuccess);
  }
  ~SmHold() {
    cudaStreamSynchronize(stream_);
    cudaEventDestroy(done_);
    cudaStreamDestroy(stream_);
  }
  SmHold(const SmHold&) = delete;
  SmHold& operator=(const SmHold&) = delete;

  bool still_held() const { return cudaEventQuery(done_) == cudaErrorNotReady; }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_ = nullptr;
};

}  // namespace
}  // namespace mok::test
