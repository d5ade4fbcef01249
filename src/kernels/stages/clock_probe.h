// The SM clock over a stretch of a stream's work, measured on the device: a probe launch before
// and after it records, on each SM it lands on, the SM's cycle counter and the global nanosecond
// timer. An SM's cycles over the nanoseconds between the two probes are its average clock over
// the stretch, whatever the power limit or the clock governor did meanwhile: what the stage
// profiles (GpuLayer::profile_forward / profile_backward) report beside each stage's time, so that
// a stage that slows in the layer but not alone shows whether its clock fell. Plain host C++.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace mok::kernels {

// What one CTA of a probe recorded (`written` 0: the slot was not written).
struct ClockSample {
  uint64_t sm_cycles = 0;    // clock64() of the SM the CTA ran on
  uint64_t nanoseconds = 0;  // %globaltimer
  uint32_t sm = 0;           // %smid
  uint32_t written = 0;
};

// `count` one-warp CTAs, CTA i writing samples[i]; in stream order (not overlapped), so it runs
// once the work before it finished. With count = the SM count, one CTA usually lands on each SM.
cudaError_t launch_clock_probe(ClockSample* samples, int count, cudaStream_t stream);

// The average SM clock in GHz between two probes of `count` samples each: for every SM that both
// probes wrote a sample of (the first sample of an SM in each), its cycles over the nanoseconds
// between them; the median over those SMs. 0 when no SM is in both or no time passed.
double median_sm_clock_ghz(const ClockSample* before, const ClockSample* after, int count);

}  // namespace mok::kernels
