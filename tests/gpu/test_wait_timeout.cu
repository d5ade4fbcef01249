// A deliberately unsatisfiable device wait must end in a bounded, diagnosed timeout, never a
// hang. The abort (a memory fault) kills the CUDA context, so the wait runs in a death-test child
// process.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

#include "kernels/common/wait.cuh"
#include "wait_record.h"

namespace mok {
namespace {

__global__ void never_ready_kernel(kernels::WaitContext context, const int* flag) {
  kernels::wait_until(
      context, kernels::WaitSite::kTestNeverReady,
      [&] { return *reinterpret_cast<const volatile int*>(flag) == 1; },
      [&] { return *reinterpret_cast<const volatile int*>(flag); }, 1);
}

// Child process: run the wait with a 0.2 s timeout; report the host-side diagnosis and exit 3.
void run_never_ready_wait() {
  const test::WaitRecord record;
  int* flag = nullptr;
  if (cudaMalloc(&flag, sizeof(int)) != cudaSuccess ||
      cudaMemset(flag, 0, sizeof(int)) != cudaSuccess)
    std::exit(12);
  const kernels::WaitContext context = record.context(200'000'000ull, 5);
  const auto start = std::chrono::steady_clock::now();
  never_ready_kernel<<<2, 64>>>(context, flag);
  const cudaError_t status = cudaDeviceSynchronize();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::fprintf(stderr, "kernel ended after %.2f s with '%s'\n", seconds,
               cudaGetErrorString(status));
  if (status == cudaSuccess || !record.timed_out() || seconds > 30) std::exit(13);
  std::fprintf(stderr, "%s\n", record.report().c_str());
  std::_Exit(3);  // the context is gone: skip destructors that would call into it
}

TEST(WaitTimeout, UnsatisfiableWaitEndsInDiagnosis) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      run_never_ready_wait(), ::testing::ExitedWithCode(3),
      "device wait timed out after 0\\.[0-9]+ s: rank 5, SM [0-9]+, block [01], thread [0-9]+, "
      "the test's never-ready condition \\(expected 1, seen 0\\)");
}

}  // namespace
}  // namespace mok
