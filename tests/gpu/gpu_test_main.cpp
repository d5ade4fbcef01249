// Entry point of the GPU test suite. Without a usable CUDA device it prints why and exits with
// 77, which ctest reports as skipped (CMakeLists.txt sets SKIP_RETURN_CODE 77): CI machines have
// no GPU, and the suite runs on a device machine through scripts/gpu-check.sh.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "wait_record.h"

namespace {

constexpr int kSkipReturnCode = 77;

// Prints the process's wait diagnosis (wait_record.h) under the first test that fails after a
// device wait timed out: the abort leaves only "illegal memory access" in the CUDA errors, and
// every later test of the process fails on the dead context.
class WaitDiagnosisPrinter : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& test) override {
    if (printed_ || !test.result()->Failed()) return;
    const std::string report = mok::test::test_wait_report();
    if (report.empty()) return;
    printed_ = true;
    std::printf("[ DIAGNOSIS ] %s.%s: %s (the CUDA context is gone: later tests fail on it)\n",
                test.test_suite_name(), test.name(), report.c_str());
    std::fflush(stdout);
  }
  bool printed_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  int device_count = 0;
  const cudaError_t error = cudaGetDeviceCount(&device_count);
  if (error != cudaSuccess || device_count == 0) {
    std::printf(
        "mok GPU tests SKIPPED: no CUDA GPU (%s) -- they run on a device machine through "
        "scripts/gpu-check.sh\n",
        error != cudaSuccess ? cudaGetErrorString(error) : "cudaGetDeviceCount found 0 devices");
    return kSkipReturnCode;
  }
  cudaDeviceProp prop{};
  const cudaError_t prop_error = cudaGetDeviceProperties(&prop, 0);
  if (prop_error != cudaSuccess) {
    std::printf("mok GPU tests: cudaGetDeviceProperties(0) failed: %s\n",
                cudaGetErrorString(prop_error));
    return 1;
  }
  std::printf("mok GPU tests on device 0 of %d: %s, %d SMs, compute capability %d.%d\n",
              device_count, prop.name, prop.multiProcessorCount, prop.major, prop.minor);
  if (prop.major != 9 || prop.minor != 0)
    std::printf(
        "mok GPU tests: WARNING: kernels are built for sm_90a only; this device will "
        "fail to launch them\n");
  std::fflush(stdout);
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::UnitTest::GetInstance()->listeners().Append(new WaitDiagnosisPrinter);
  return RUN_ALL_TESTS();
}
