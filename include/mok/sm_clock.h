// The SM clock over a stretch of a stream's work, measured on the device: open() and close()
// launch a probe before and after it (a one-warp CTA per SM that records the SM's cycle counter
// and the global timer), and ghz() is each SM's cycles over the nanoseconds between the two,
// the median over the SMs that both probes reached. What a benchmark reports beside a time: on a
// power-limited card a kernel's time is its work per cycle over the clock its power draw leaves.
// The stage profiles (GpuLayer::profile_forward / profile_backward) use the same probes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mok {

class SmClockWindow {
 public:
  // For the current device; allocates the probes' device memory (synchronizes).
  SmClockWindow();
  ~SmClockWindow();
  SmClockWindow(const SmClockWindow&) = delete;
  SmClockWindow& operator=(const SmClockWindow&) = delete;

  // The probe before the work (stream order; no host synchronization).
  void open(cudaStream_t stream);
  // The probe after it.
  void close(cudaStream_t stream);
  // The average SM clock in GHz between the last open() and close(): waits for the closing
  // probe. 0 when no SM was reached by both, or no time passed.
  double ghz();

 private:
  int sm_count_ = 0;
  void* probes_ = nullptr;  // 2 x sm_count_ kernels::ClockSample
  cudaEvent_t closed_ = nullptr;
};

}  // namespace mok
