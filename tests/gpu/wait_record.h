// A timed-out device wait's diagnosis for the GPU tests that launch waiting kernels themselves
// (a GpuLayer keeps its own): a WaitDiagnosis in mapped pinned host memory, which the host can
// still read after the wait's abort has killed the CUDA context. test_wait_context() hands out
// the process's record; gpu_test_main.cpp prints its diagnosis under the first test that fails
// after a wait timed out, instead of leaving only the abort's "illegal memory access".
#pragma once

#include <cstdint>
#include <string>

#include "kernels/common/wait_types.h"

namespace mok::test {

// The GPU tests' device-wait timeout: far above any test kernel's run time.
inline constexpr uint64_t kTestWaitTimeoutNs = 10'000'000'000ull;

class WaitRecord {
 public:
  WaitRecord();  // throws std::runtime_error naming the CUDA call that failed
  ~WaitRecord();
  WaitRecord(const WaitRecord&) = delete;
  WaitRecord& operator=(const WaitRecord&) = delete;

  // The context a waiting kernel takes: its waits record into this.
  kernels::WaitContext context(uint64_t timeout_ns = kTestWaitTimeoutNs, int32_t rank = 0) const;
  bool timed_out() const;
  // The diagnosis in words (describe_wait_diagnosis), or "" while no wait timed out.
  std::string report() const;

 private:
  kernels::WaitDiagnosis* host_ = nullptr;
  kernels::WaitDiagnosis* device_ = nullptr;
};

// The process's record (made on first use; kept until exit) with the tests' timeout.
kernels::WaitContext test_wait_context(int32_t rank = 0, uint64_t timeout_ns = kTestWaitTimeoutNs);
// The process record's diagnosis, or "" (also when no test asked for a context).
std::string test_wait_report();

}  // namespace mok::test
