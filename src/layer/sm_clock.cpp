// mok::SmClockWindow (mok/sm_clock.h) on the clock probes of kernels/stages/clock_probe.h.
#include "mok/sm_clock.h"

#include <string>
#include <vector>

#include "kernels/stages/clock_probe.h"
#include "layer/cuda_buffer.h"

namespace mok {

struct SmClockWindow::Probes {
  int marks = 0;
  int sm_count = 0;
  DeviceBuffer samples;  // marks x sm_count kernels::ClockSample
  cudaEvent_t latest = nullptr;
  std::vector<kernels::ClockSample> host;  // read after the latest mark; empty when stale
};

SmClockWindow::SmClockWindow(int marks) : probes_(std::make_unique<Probes>()) {
  if (marks < 2)
    throw Error(ErrorCode::kInvalidArgument,
                "SmClockWindow: marks = " + std::to_string(marks) + "; valid: 2 or more");
  Probes& p = *probes_;
  p.marks = marks;
  int device = 0;
  cuda_check(cudaGetDevice(&device), "SmClockWindow: cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&p.sm_count, cudaDevAttrMultiProcessorCount, device),
             "SmClockWindow: the SM count");
  const int64_t bytes = int64_t{marks} * p.sm_count * sizeof(kernels::ClockSample);
  p.samples.allocate(bytes, "SmClockWindow's probes");
  cuda_check(cudaMemset(p.samples.pointer, 0, bytes), "SmClockWindow: clear the probes");
  cuda_check(cudaEventCreateWithFlags(&p.latest, cudaEventDisableTiming),
             "SmClockWindow: cudaEventCreate");
}

SmClockWindow::~SmClockWindow() {
  if (probes_ != nullptr && probes_->latest != nullptr) cudaEventDestroy(probes_->latest);
}

void SmClockWindow::mark(int index, cudaStream_t stream) {
  Probes& p = *probes_;
  if (index < 0 || index >= p.marks)
    throw Error(ErrorCode::kInvalidArgument,
                "SmClockWindow::mark: index = " + std::to_string(index) + "; valid: 0 to " +
                    std::to_string(p.marks - 1));
  cuda_check(
      kernels::launch_clock_probe(
          p.samples.as<kernels::ClockSample>() + int64_t{index} * p.sm_count, p.sm_count, stream),
      "SmClockWindow::mark: the clock probe");
  cuda_check(cudaEventRecord(p.latest, stream), "SmClockWindow::mark: cudaEventRecord");
  p.host.clear();
}

double SmClockWindow::ghz(int first, int last) {
  Probes& p = *probes_;
  if (first < 0 || last < 0 || first >= p.marks || last >= p.marks)
    throw Error(ErrorCode::kInvalidArgument, "SmClockWindow::ghz: marks " + std::to_string(first) +
                                                 " and " + std::to_string(last) + "; valid: 0 to " +
                                                 std::to_string(p.marks - 1));
  if (p.host.empty()) {
    cuda_check(cudaEventSynchronize(p.latest), "SmClockWindow::ghz: wait for the latest mark");
    p.host.resize(static_cast<size_t>(p.marks) * p.sm_count);
    cuda_check(cudaMemcpy(p.host.data(), p.samples.pointer, p.host.size() * sizeof(p.host[0]),
                          cudaMemcpyDeviceToHost),
               "SmClockWindow::ghz: read the probes");
  }
  return kernels::median_sm_clock_ghz(p.host.data() + int64_t{first} * p.sm_count,
                                      p.host.data() + int64_t{last} * p.sm_count, p.sm_count);
}

}  // namespace mok
