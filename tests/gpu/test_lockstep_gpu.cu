// MoeConfig::gemm_lockstep_k_blocks (src/kernels/gemm/lockstep.h): the row-tile GEMMs with
// their CTAs kept in step give the bits of the free-running ones at every lead (a tick per
// K-block, the default-like 16, one tick per tile), on the four-stage ring, under the L2
// placement, in the 256 x 192 tiles, with macrobatches and in FP8, with and without the forward
// context; and a step finishes with those bits while another stream holds all but 8 SMs, so that
// most of a launch's CTAs start only after others have ended (the lockstep waits only on CTAs that
// have started). MoeConfig::gemm_auto_lockstep turns both on at a shape whose weights stream,
// with the bits of the layer without it.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpu_step.h"
#include "mok/gpu_layer.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "sm_hold.cuh"
#include "test_util.h"

namespace mok {
namespace {

using test::make_shape;

MoeConfig in_step(int32_t lead) {
  MoeConfig config;
  config.gemm_lockstep_k_blocks = lead;
  return config;
}

TEST(LockstepGpu, SameBitsAtEveryLead) {
  const MoeShape shape = make_shape(700, 1024, 384, 16, 4, 1, 128);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 71);
  DeviceProblem device(problem, 0);
  GpuLayer reference(shape, MoeConfig{});
  std::vector<MoeConfig> configs = {in_step(2), in_step(16), in_step(kMaxLockstepKBlocks)};
  configs.push_back(in_step(16));
  configs.back().gemm_four_stages = true;
  configs.push_back(in_step(16));
  configs.back().gemm_l2_placement = true;
  configs.push_back(in_step(16));
  configs.back().gemm_wide_tiles = true;
  configs.push_back(in_step(4));
  configs.back().minibatch_size = 128;
  configs.back().macrobatch_size = 384;
  for (const MoeConfig& config : configs) {
    GpuLayer layer(shape, config);
    test::expect_same_steps(reference, layer, device, problem,
                            ", lead " + std::to_string(config.gemm_lockstep_k_blocks) +
                                " four stages " + std::to_string(config.gemm_four_stages) +
                                " L2 placement " + std::to_string(config.gemm_l2_placement) +
                                " 256 x 192 tiles " + std::to_string(config.gemm_wide_tiles) +
                                " macrobatch " + std::to_string(config.macrobatch_size));
  }
}

// The FP8 row-tile GEMMs in step give the bits of the free-running ones, with a shared expert,
// with and without the forward context.
TEST(LockstepGpu, Fp8KeepsTheBits) {
  const MoeShape shape = make_shape(512, 1024, 384, 16, 4, 1, 256);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 73);
  DeviceProblem device(problem, 0);
  MoeConfig free_running;
  free_running.precision = Precision::kFP8Block;
  GpuLayer reference(shape, free_running);
  for (const int32_t lead : {2, 16}) {
    MoeConfig config = free_running;
    config.gemm_lockstep_k_blocks = lead;
    GpuLayer layer(shape, config);
    test::expect_same_steps(reference, layer, device, problem,
                            ", FP8, lead " + std::to_string(lead));
  }
}

TEST(LockstepGpu, FinishesOnTheSmsLeftToIt) {
  test::expect_config_finishes_on_held_sms(in_step(2), 97);  // a tick per K-block
}

// 64 experts of 2048 x 1408 (1.1 GB of weights) at 128 routed rows each: the automatic rule runs
// four stages in step within 16 K-blocks, and GpuLayer::config() says so.
TEST(LockstepGpu, AutomaticAtAStreamingShape) {
  const MoeShape shape = make_shape(1024, 2048, 1408, 64, 8);
  ASSERT_TRUE(auto_lockstep_engages(MoeConfig{}, shape));
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 73);
  DeviceProblem device(problem, 0);
  MoeConfig free_running;
  free_running.gemm_auto_lockstep = false;
  GpuLayer reference(shape, free_running);
  GpuLayer automatic(shape, MoeConfig{});
  EXPECT_FALSE(reference.config().gemm_four_stages);
  EXPECT_EQ(reference.config().gemm_lockstep_k_blocks, 0);
  EXPECT_TRUE(automatic.config().gemm_four_stages);
  EXPECT_EQ(automatic.config().gemm_lockstep_k_blocks, kAutoLockstepKBlocks);
  test::expect_same_steps(reference, automatic, device, problem, ", automatic lockstep");
}

}  // namespace
}  // namespace mok
