// MoeConfig::gemm_l2_placement (src/kernels/gemm/l2_placement.h). The slot claims give every
// slot to exactly one CTA of a launch, launch after launch, with every SM free and with all but
// 8 held by another stream (most CTAs then find their SM's slot taken). The standalone expert GEMMs
// with each L2 partition's SMs on their share of the row tiles give the bits of the block-index
// walk, alone and with macrobatches, with and without the forward context; and they finish with
// those bits while another stream holds all but 8 SMs, so that most CTAs run on an SM that
// already ran one of their launch and must claim another slot. The layer says what its probe
// found (printed: whether H200's latencies show two partitions is what the probe measures).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "device_memory.h"
#include "gpu_step.h"
#include "kernels/gemm/l2_placement.h"
#include "mok/gpu_layer.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "sm_hold.cuh"
#include "test_util.h"

namespace mok {
namespace {

using test::make_shape;

// Each CTA claims a slot (after a short spin, so that CTAs overlap) and records it.
__global__ void claim_slots_kernel(kernels::L2Placement placement, int32_t* slot_of_block) {
  if (threadIdx.x != 0) return;
  const long long start = clock64();
  while (clock64() - start < 200'000) {
  }
  slot_of_block[blockIdx.x] = kernels::claim_l2_slot(placement);
}

__global__ void advance_kernel(unsigned long long* epoch) { *epoch += 1; }

TEST(L2PlacementGpu, ClaimsGiveEverySlotOnce) {
  int device = 0, sms = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  // A made-up slot table over SM ids 0..1023: a permutation of the slots, the rest -1.
  std::vector<int32_t> slot_of_sm(1024, -1);
  for (int32_t id = 0; id < sms; ++id) slot_of_sm[id] = (id * 37 + 5) % sms;
  test::DeviceAllocations memory;
  int32_t* table = test::upload(memory, slot_of_sm);
  int32_t* slots = memory.allocate<int32_t>(sms * sizeof(int32_t));
  unsigned long long* claims =
      memory.allocate<unsigned long long>((sms + 1) * sizeof(unsigned long long));
  ASSERT_EQ(cudaMemset(claims, 0, (sms + 1) * sizeof(unsigned long long)), cudaSuccess);
  kernels::L2Placement placement;
  placement.slot_of_sm = table;
  placement.num_sm_ids = static_cast<int32_t>(slot_of_sm.size());
  placement.lower_slots = sms / 2;
  placement.claims = claims;
  placement.epoch = claims + sms;
  // As much shared memory as the GEMMs ask (more than SmHold leaves on a held SM): one CTA per
  // SM, and under the hold only the 8 free SMs, each running CTA after CTA.
  constexpr int kSharedBytes = 200 * 1024;
  ASSERT_EQ(cudaFuncSetAttribute(claim_slots_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 kSharedBytes),
            cudaSuccess);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  auto check_launch = [&](const char* when) {
    claim_slots_kernel<<<sms, 32, kSharedBytes, stream>>>(placement, slots);
    advance_kernel<<<1, 1, 0, stream>>>(claims + sms);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess) << when;
    std::vector<int32_t> got(sms);
    ASSERT_EQ(cudaMemcpy(got.data(), slots, sms * sizeof(int32_t), cudaMemcpyDeviceToHost),
              cudaSuccess);
    std::sort(got.begin(), got.end());
    for (int32_t s = 0; s < sms; ++s) EXPECT_EQ(got[s], s) << when << ": slot " << s;
  };
  for (int launch = 0; launch < 3; ++launch) check_launch("every SM free");
  {
    const test::SmHold hold(8, 2'000'000'000ull);
    for (int launch = 0; launch < 3; ++launch) check_launch("8 SMs free");
  }
  cudaStreamDestroy(stream);
}

MoeConfig placed(int64_t minibatch = 0, int64_t macrobatch = 0) {
  MoeConfig config;
  config.gemm_l2_placement = true;
  config.minibatch_size = minibatch;
  config.macrobatch_size = macrobatch;
  return config;
}

TEST(L2PlacementGpu, SameBitsAsTheBlockWalk) {
  const MoeShape shape = make_shape(700, 1024, 384, 16, 4, 1, 128);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 61);
  DeviceProblem device(problem, 0);
  GpuLayer reference(shape, MoeConfig{});
  for (const MoeConfig& config : {placed(), placed(128, 384)}) {
    GpuLayer layer(shape, config);
    std::printf("  %s\n", layer.l2_placement_report().c_str());
    EXPECT_FALSE(layer.l2_placement_report().empty());
    for (const bool with_context : {true, false}) {
      SCOPED_TRACE(testing::Message() << "macrobatch " << config.macrobatch_size
                                      << (with_context ? "" : ", no context"));
      const HostRank want = test::gpu_step(reference, device, problem, with_context);
      const HostRank got = test::gpu_step(layer, device, problem, with_context);
      test::for_each_output(got, want, [&](const char* output, const auto& a, const auto& b) {
        EXPECT_TRUE(test::bitwise_equal(a, b)) << output;
      });
    }
  }
  EXPECT_TRUE(GpuLayer(shape, MoeConfig{}).l2_placement_report().empty());
}

TEST(L2PlacementGpu, FinishesOnTheSmsLeftToIt) {
  test::expect_config_finishes_on_held_sms(placed(), 93);
}

}  // namespace
}  // namespace mok
