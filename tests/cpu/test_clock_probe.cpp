// How two clock probes' samples become a stage's SM clock (kernels::median_sm_clock_ghz): paired
// by SM, the first sample of an SM in each probe, unwritten and unpaired samples left out, the
// median over the SMs. The probe kernel itself runs in tests/gpu (ClockProbeGpu).
#include <gtest/gtest.h>

#include <vector>

#include "kernels/stages/clock_probe.h"

namespace mok {
namespace {

using kernels::ClockSample;
using kernels::median_sm_clock_ghz;

ClockSample sample(uint32_t sm, uint64_t cycles, uint64_t nanoseconds) {
  ClockSample s;
  s.sm = sm;
  s.sm_cycles = cycles;
  s.nanoseconds = nanoseconds;
  s.written = 1;
  return s;
}

TEST(ClockProbe, PairsTheSamplesBySm) {
  // The CTAs landed on the SMs in another order the second time; each SM's counter starts
  // elsewhere. SMs 0-2 ran at 1.5, 1.6 and 1.7 GHz over 1 ms.
  const std::vector<ClockSample> before = {
      sample(0, 1000, 5'000'000), sample(1, 7'000'000, 5'000'000), sample(2, 50, 5'000'100)};
  const std::vector<ClockSample> after = {sample(2, 50 + 1'700'000, 6'000'100),
                                          sample(0, 1000 + 1'500'000, 6'000'000),
                                          sample(1, 7'000'000 + 1'600'000, 6'000'000)};
  EXPECT_DOUBLE_EQ(median_sm_clock_ghz(before.data(), after.data(), 3), 1.6);
}

TEST(ClockProbe, LeavesOutUnwrittenUnpairedAndRepeatedSamples) {
  std::vector<ClockSample> before = {sample(4, 0, 0), sample(4, 999'999, 0), sample(5, 0, 0),
                                     sample(6, 0, 0)};
  std::vector<ClockSample> after = {sample(4, 1'200'000, 1'000'000), sample(4, 1, 1'000'000),
                                    sample(7, 0, 1'000'000), sample(6, 1'800'000, 1'000'000)};
  after[3].written = 0;  // SM 6's second sample was not written
  // Only SM 4 pairs, through its first sample in each probe: 1.2 GHz.
  EXPECT_DOUBLE_EQ(median_sm_clock_ghz(before.data(), after.data(), 4), 1.2);
}

TEST(ClockProbe, NoClockWithoutAPairOrWithoutTime) {
  const std::vector<ClockSample> before = {sample(0, 0, 100), sample(1, 0, 100)};
  const std::vector<ClockSample> no_pair = {sample(2, 10, 200), sample(3, 10, 200)};
  EXPECT_EQ(median_sm_clock_ghz(before.data(), no_pair.data(), 2), 0.0);
  const std::vector<ClockSample> no_time = {sample(0, 10, 100), sample(1, 10, 100)};
  EXPECT_EQ(median_sm_clock_ghz(before.data(), no_time.data(), 2), 0.0);
  const std::vector<ClockSample> unwritten(2);
  EXPECT_EQ(median_sm_clock_ghz(unwritten.data(), no_pair.data(), 2), 0.0);
}

}  // namespace
}  // namespace mok
