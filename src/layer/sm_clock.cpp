// mok::SmClockWindow (mok/sm_clock.h) on the clock probes of kernels/stages/clock_probe.h.
#include "mok/sm_clock.h"

#include <string>
#include <vector>

#include "kernels/stages/clock_probe.h"
#include "layer/cuda_buffer.h"

namespace mok {

SmClockWindow::SmClockWindow() {
  int device = 0;
  cuda_check(cudaGetDevice(&device), "SmClockWindow: cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device),
             "SmClockWindow: the SM count");
  cuda_check(cudaMalloc(&probes_, 2 * sm_count_ * sizeof(kernels::ClockSample)),
             "cudaMalloc of SmClockWindow's probes");
  cuda_check(cudaMemset(probes_, 0, 2 * sm_count_ * sizeof(kernels::ClockSample)),
             "SmClockWindow: clear the probes");
  cuda_check(cudaEventCreateWithFlags(&closed_, cudaEventDisableTiming),
             "SmClockWindow: cudaEventCreate");
}

SmClockWindow::~SmClockWindow() {
  if (closed_ != nullptr) cudaEventDestroy(closed_);
  if (probes_ != nullptr) cudaFree(probes_);
}

void SmClockWindow::open(cudaStream_t stream) {
  cuda_check(
      kernels::launch_clock_probe(static_cast<kernels::ClockSample*>(probes_), sm_count_, stream),
      "SmClockWindow::open: the clock probe");
}

void SmClockWindow::close(cudaStream_t stream) {
  cuda_check(kernels::launch_clock_probe(static_cast<kernels::ClockSample*>(probes_) + sm_count_,
                                         sm_count_, stream),
             "SmClockWindow::close: the clock probe");
  cuda_check(cudaEventRecord(closed_, stream), "SmClockWindow::close: cudaEventRecord");
}

double SmClockWindow::ghz() {
  cuda_check(cudaEventSynchronize(closed_), "SmClockWindow::ghz: wait for the closing probe");
  std::vector<kernels::ClockSample> probed(2 * sm_count_);
  cuda_check(
      cudaMemcpy(probed.data(), probes_, probed.size() * sizeof(probed[0]), cudaMemcpyDeviceToHost),
      "SmClockWindow::ghz: read the probes");
  return kernels::median_sm_clock_ghz(probed.data(), probed.data() + sm_count_, sm_count_);
}

}  // namespace mok
