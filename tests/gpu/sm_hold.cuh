// Keeps all but a few SMs busy for a while, for the tests that a persistent kernel finishes on
// the SMs left to it (its CTAs must not wait for CTAs that cannot become resident).
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <stdint.h>

#include "gpu_step.h"
#include "mok/gpu_layer.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "test_util.h"

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

// One step of `layer` (forward with the context, backward) while another stream holds all but
// 8 SMs, so that most CTAs of each launch start only once others have ended: it must end before
// the hold does, with the bits `want` (the same step on every SM). gpu_step synchronizes the
// device, which would wait for the hold: the held step runs on a stream of its own, its outputs
// poisoned before the hold starts.
inline void expect_same_bits_on_held_sms(GpuLayer& layer, DeviceProblem& device,
                                         const HostProblem& problem, const HostRank& want) {
  cudaStream_t layer_stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&layer_stream, cudaStreamNonBlocking), cudaSuccess);
  gpu_step(layer, device, problem, true);  // warm-up: kernel attributes, module load
  device.poison_outputs();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  {
    const SmHold hold(8, 3'000'000'000ull);
    const Status status = launch_step(layer, device, true, layer_stream);
    ASSERT_TRUE(status.ok()) << status.message;
    EXPECT_TRUE(hold.still_held()) << "the step only finished after the SM-holding kernel exited";
  }
  for_each_output(downloaded_outputs(device, problem), want,
                  [&](const char* output, const auto& a, const auto& b) {
                    EXPECT_TRUE(bitwise_equal(a, b)) << output;
                  });
  cudaStreamDestroy(layer_stream);
}

// The same for a layer of `config` (built, and any probe it runs done, with every SM free) at a
// shape of 1500 tokens over 16 experts, whose GEMM launches have many more CTAs than 8 SMs: the
// bits are the default layer's.
inline void expect_config_finishes_on_held_sms(const MoeConfig& config, uint64_t seed) {
  const MoeShape shape = make_shape(1500, 1024, 512, 16, 4);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, seed);
  DeviceProblem device(problem, 0);
  GpuLayer reference(shape, MoeConfig{});
  const HostRank want = gpu_step(reference, device, problem, true);
  GpuLayer layer(shape, config);
  expect_same_bits_on_held_sms(layer, device, problem, want);
}

}  // namespace
}  // namespace mok::test
