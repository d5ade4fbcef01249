// The clock probe (clock_probe.h): one warp per CTA, lane 0 reads its SM's id, cycle counter and
// the global timer and writes them to its CTA's slot. The host pairs two probes' samples by SM.
#include <algorithm>
#include <vector>

#include "kernels/common/ptx.cuh"
#include "kernels/stages/clock_probe.h"

namespace mok::kernels {

namespace {

__global__ void clock_probe_kernel(ClockSample* samples) {
  if (threadIdx.x != 0) return;
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  ClockSample sample;
  sample.nanoseconds = ptx::globaltimer_ns();
  sample.sm_cycles = clock64();
  sample.sm = sm;
  sample.written = 1;
  samples[blockIdx.x] = sample;
}

// Index of the first written sample of SM `sm` in samples[0, count), or -1.
int first_of_sm(const ClockSample* samples, int count, uint32_t sm) {
  for (int i = 0; i < count; ++i)
    if (samples[i].written != 0 && samples[i].sm == sm) return i;
  return -1;
}

}  // namespace

cudaError_t launch_clock_probe(ClockSample* samples, int count, cudaStream_t stream) {
  if (samples == nullptr || count <= 0) return cudaErrorInvalidValue;
  clock_probe_kernel<<<count, 32, 0, stream>>>(samples);
  return cudaGetLastError();
}

double median_sm_clock_ghz(const ClockSample* before, const ClockSample* after, int count) {
  std::vector<double> clocks;
  for (int i = 0; i < count; ++i) {
    if (before[i].written == 0 || first_of_sm(before, count, before[i].sm) != i) continue;
    const int j = first_of_sm(after, count, before[i].sm);
    if (j < 0 || after[j].nanoseconds <= before[i].nanoseconds ||
        after[j].sm_cycles < before[i].sm_cycles)
      continue;
    clocks.push_back(static_cast<double>(after[j].sm_cycles - before[i].sm_cycles) /
                     static_cast<double>(after[j].nanoseconds - before[i].nanoseconds));
  }
  if (clocks.empty()) return 0.0;
  std::sort(clocks.begin(), clocks.end());
  return clocks[clocks.size() / 2];
}

}  // namespace mok::kernels
