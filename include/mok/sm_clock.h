// The SM clock over stretches of a stream's work, measured on the device: each mark launches a
// probe (a one-warp CTA per SM that records the SM's cycle counter and the global timer), and
// the clock between two marks is each SM's cycles over the nanoseconds between them, the median
// over the SMs that both probes reached. What a benchmark reports beside a time: on a
// power-limited card a kernel's time is its work per cycle over the clock its power draw leaves.
// The stage profiles (GpuLayer::profile_forward / profile_backward) mark every stage with one.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

namespace mok {

class SmClockWindow {
 public:
  // Room for `marks` probes (at least 2) on the current device; allocates (synchronizes).
  explicit SmClockWindow(int marks = 2);
  ~SmClockWindow();
  SmClockWindow(const SmClockWindow&) = delete;
  SmClockWindow& operator=(const SmClockWindow&) = delete;

  // Probe `index` (0 <= index < marks) in stream order; no host synchronization.
  void mark(int index, cudaStream_t stream);
  // The average SM clock in GHz between marks `first` and `last`: waits for the latest mark and
  // reads the probes once per new mark. 0 when no SM was reached by both, or no time passed.
  double ghz(int first, int last);

  // Two marks around one stretch: open() is mark 0, close() mark 1, ghz() the clock between.
  void open(cudaStream_t stream) { mark(0, stream); }
  void close(cudaStream_t stream) { mark(1, stream); }
  double ghz() { return ghz(0, 1); }

 private:
  struct Probes;  // device samples, the latest mark's event, their host copy
  std::unique_ptr<Probes> probes_;
};

}  // namespace mok
