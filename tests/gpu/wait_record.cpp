// WaitRecord (wait_record.h): the record in mapped pinned host memory, and the process's one.
#include "wait_record.h"

#include <cuda_runtime_api.h>

#include <mutex>

#include "device_memory.h"
#include "layer/wait_report.h"

namespace mok::test {

namespace {

std::mutex process_record_mutex;
WaitRecord* process_record = nullptr;  // made on first use, never freed (see test_wait_context)

}  // namespace

WaitRecord::WaitRecord() {
  // Portable: the multi-GPU tests' kernels on every device write the one record.
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&host_), sizeof(*host_),
                           cudaHostAllocMapped | cudaHostAllocPortable));
  *host_ = kernels::WaitDiagnosis{};
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&device_), host_, 0));
}

WaitRecord::~WaitRecord() { cudaFreeHost(host_); }

kernels::WaitContext WaitRecord::context(uint64_t timeout_ns, int32_t rank) const {
  return kernels::WaitContext{timeout_ns, rank, device_};
}

bool WaitRecord::timed_out() const {
  return reinterpret_cast<const volatile kernels::WaitDiagnosis*>(host_)->timed_out == 1;
}

std::string WaitRecord::report() const {
  if (!timed_out()) return "";
  const kernels::WaitDiagnosis copy = *host_;
  return describe_wait_diagnosis(copy);
}

kernels::WaitContext test_wait_context(int32_t rank, uint64_t timeout_ns) {
  // Never freed: a record freed at exit would race the CUDA runtime's own teardown, and one
  // whose context died can only be freed into an error.
  const std::lock_guard<std::mutex> lock(process_record_mutex);
  if (process_record == nullptr) process_record = new WaitRecord();
  return process_record->context(timeout_ns, rank);
}

std::string test_wait_report() {
  const std::lock_guard<std::mutex> lock(process_record_mutex);
  return process_record == nullptr ? std::string() : process_record->report();
}

}  // namespace mok::test
