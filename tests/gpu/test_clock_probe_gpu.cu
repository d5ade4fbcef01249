// The clock probes (kernels/stages/clock_probe.h) on the GPU: around a kernel that spins a known
// number of cycles on every SM, the probes' clock agrees with the spin's own (its cycles over its
// own global-timer span); and the layer's stage profiles report a clock for every stage long
// enough to have one.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "device_memory.h"
#include "kernels/common/ptx.cuh"
#include "kernels/stages/clock_probe.h"
#include "mok/gpu_layer.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "test_util.h"

namespace mok {
namespace {

using kernels::ClockSample;

// Each CTA spins `cycles` SM cycles and records its own clock: cycles over its timer span, in
// GHz (a CTA per SM, all resident at once).
__global__ void spin_kernel(int64_t cycles, double* ghz) {
  if (threadIdx.x != 0) return;
  const uint64_t start_ns = ptx::globaltimer_ns();
  const int64_t start = clock64();
  int64_t now = start;
  while (now - start < cycles) now = clock64();
  const uint64_t end_ns = ptx::globaltimer_ns();
  ghz[blockIdx.x] = end_ns > start_ns ? double(now - start) / double(end_ns - start_ns) : 0.0;
}

TEST(ClockProbeGpu, AgreesWithASpinOfKnownCycles) {
  int device = 0, sm_count = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  test::DeviceAllocations memory;
  ClockSample* samples = memory.allocate<ClockSample>(2 * sm_count * sizeof(ClockSample));
  double* spin_ghz = memory.allocate<double>(sm_count * sizeof(double));
  ASSERT_EQ(cudaMemset(samples, 0, 2 * sm_count * sizeof(ClockSample)), cudaSuccess);
  ASSERT_EQ(kernels::launch_clock_probe(samples, sm_count, nullptr), cudaSuccess);
  spin_kernel<<<sm_count, 32>>>(int64_t{20'000'000}, spin_ghz);  // ~10-20 ms at 1-2 GHz
  ASSERT_EQ(kernels::launch_clock_probe(samples + sm_count, sm_count, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<ClockSample> probed(2 * sm_count);
  std::vector<double> spun(sm_count);
  ASSERT_EQ(cudaMemcpy(probed.data(), samples, probed.size() * sizeof(ClockSample),
                       cudaMemcpyDeviceToHost),
            cudaSuccess);
  ASSERT_EQ(cudaMemcpy(spun.data(), spin_ghz, spun.size() * sizeof(double), cudaMemcpyDeviceToHost),
            cudaSuccess);
  int written = 0;
  for (const ClockSample& s : probed) written += s.written;
  EXPECT_EQ(written, 2 * sm_count) << "every probe CTA writes its sample";
  const double probes =
      kernels::median_sm_clock_ghz(probed.data(), probed.data() + sm_count, sm_count);
  std::sort(spun.begin(), spun.end());
  const double spin = spun[spun.size() / 2];
  std::printf("  SM clock over the spin: probes %.3f GHz, the spin's own %.3f GHz\n", probes, spin);
  EXPECT_GT(spin, 0.3);
  EXPECT_LT(spin, 3.0);
  // The probes' span holds the spin plus two launch gaps (microseconds against ~10 ms).
  EXPECT_NEAR(probes, spin, 0.05 * spin);
}

TEST(ClockProbeGpu, StageProfilesReportEveryStagesClock) {
  const MoeShape shape = test::make_shape(4096, 1024, 512, 16, 4);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 7);
  DeviceProblem device(problem, 0);
  GpuLayer layer(shape, MoeConfig{});
  const ForwardArgs args = device.forward_args();
  for (const std::vector<StageTime>& stages :
       {layer.profile_forward(args, nullptr, 3),
        layer.profile_backward(device.backward_args(), nullptr, 3)}) {
    ASSERT_GE(stages.size(), 2u);
    EXPECT_EQ(stages.back().name, "total");
    for (const StageTime& stage : stages) {
      std::printf("  %-44s %8.3f ms %6.2f GHz\n", stage.name.c_str(), stage.ms, stage.sm_clock_ghz);
      EXPECT_GT(stage.ms, 0.0f) << stage.name;
      // The global timer may tick in microseconds: a stage of a few of them has no exact clock.
      if (stage.ms < 0.05f) continue;
      EXPECT_GT(stage.sm_clock_ghz, 0.3f) << stage.name;
      EXPECT_LT(stage.sm_clock_ghz, 3.0f) << stage.name;
    }
  }
}

}  // namespace
}  // namespace mok
