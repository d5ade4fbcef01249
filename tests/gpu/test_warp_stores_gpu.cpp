// The row-tile GEMMs with four stages and per-warp stores (MOK_GEMM_WARP_STORES=1;
// src/kernels/gemm/warp_stores.cuh) give the bits of the staging-tile epilogue: forward and
// backward, with and without the forward context, one macrobatch and several, with a shared
// expert whose outputs have exactly T rows (the stores leave out the rows past them).
#include <gtest/gtest.h>
#include <stdlib.h>

#include "gpu_step.h"
#include "mok/gpu_layer.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "test_util.h"

namespace mok {
namespace {

using test::make_shape;

MoeConfig batched(int64_t minibatch, int64_t macrobatch) {
  MoeConfig config;
  config.minibatch_size = minibatch;
  config.macrobatch_size = macrobatch;
  return config;
}

TEST(WarpStoresGpu, SameBitsAsTheStagingTile) {
  const MoeShape shape = make_shape(700, 1024, 384, 16, 4, 1, 128);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 67);
  DeviceProblem device(problem, 0);
  for (const MoeConfig& config : {MoeConfig{}, batched(128, 384)}) {
    GpuLayer layer(shape, config);
    for (const bool with_context : {true, false}) {
      SCOPED_TRACE(testing::Message() << "macrobatch " << config.macrobatch_size
                                      << (with_context ? "" : ", no context"));
      const HostRank want = test::gpu_step(layer, device, problem, with_context);
      ASSERT_EQ(setenv("MOK_GEMM_WARP_STORES", "1", 1), 0);
      const HostRank got = test::gpu_step(layer, device, problem, with_context);
      ASSERT_EQ(unsetenv("MOK_GEMM_WARP_STORES"), 0);
      test::for_each_output(got, want, [&](const char* output, const auto& a, const auto& b) {
        EXPECT_TRUE(test::bitwise_equal(a, b)) << output;
      });
    }
  }
}

}  // namespace
}  // namespace mok
