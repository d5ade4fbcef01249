// The persistent forward GEMM kernel (MoeConfig::persistent_forward): bitwise equal to the
// two-kernel forward on every routing, minibatch size and local dispatch mode, across repeated
// launches and CUDA-graph replays (its counters carry epochs); correct against the CPU
// reference; and it finishes while another stream holds most SMs (a task only waits on tasks
// with smaller tickets, taken by CTAs that are running).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "gpu_step.h"
#include "mok/gpu_layer.h"
#include "mok/reference.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "sm_hold.cuh"
#include "test_util.h"

namespace mok {
namespace {

using test::make_shape;

std::vector<bf16> run_forward(GpuLayer& layer, DeviceProblem& device, const HostProblem& problem,
                              cudaStream_t stream = nullptr) {
  device.poison_outputs();
  layer.forward(device.forward_args(), stream);
  const Status status = layer.synchronize(stream);
  EXPECT_TRUE(status.ok()) << status.message;
  HostRank result = output_buffers(problem.shape);
  device.download_outputs(result);
  return result.out;
}

MoeConfig persistent_config(LocalDispatch dispatch, int64_t minibatch_size) {
  MoeConfig config;
  config.persistent_forward = true;
  config.local_dispatch = dispatch;
  config.minibatch_size = minibatch_size;
  config.macrobatch_size = minibatch_size * 32;
  config.wait_timeout_s = 10;  // a lost dependency ends the test in seconds, with a diagnosis
  return config;
}

TEST(PersistentForwardGpu, BitwiseEqualToTwoKernelForward) {
  struct Case {
    const char* name;
    MoeShape shape;
    RoutingKind routing;
  };
  const std::vector<Case> cases = {
      {"uniform", make_shape(333, 1024, 384, 16, 4, 1, 128), RoutingKind::kUniform},
      {"skewed", make_shape(700, 1024, 384, 16, 4), RoutingKind::kSkewed},
      {"one expert", make_shape(300, 512, 256, 8, 4), RoutingKind::kOneExpert},
      {"holes", make_shape(333, 1024, 384, 16, 4), RoutingKind::kHoles},
      {"no routes", make_shape(130, 512, 256, 8, 4, 1, 64), RoutingKind::kNoRoutes},
      {"one token", make_shape(1, 256, 128, 8, 2), RoutingKind::kUniform},
  };
  uint64_t seed = 500;
  for (const Case& test_case : cases) {
    SCOPED_TRACE(std::string(test_case.name) + " " + test_case.shape.to_string());
    HostProblem problem = HostProblem::make(test_case.shape, test_case.routing, ++seed);
    DeviceProblem device(problem, 0);
    MoeConfig two_kernels;
    two_kernels.local_dispatch = LocalDispatch::kGatherKernel;
    GpuLayer reference_layer(test_case.shape, two_kernels);
    const std::vector<bf16> want = run_forward(reference_layer, device, problem);
    for (LocalDispatch dispatch : {LocalDispatch::kGatherKernel, LocalDispatch::kProducerWarps})
      for (int64_t minibatch : {128, 512, 4096}) {
        SCOPED_TRACE(testing::Message()
                     << local_dispatch_name(dispatch) << ", minibatch " << minibatch);
        GpuLayer layer(test_case.shape, persistent_config(dispatch, minibatch));
        for (int launch = 0; launch < 3; ++launch)
          ASSERT_TRUE(test::bitwise_equal(run_forward(layer, device, problem), want))
              << "launch " << launch;
      }
  }
}

TEST(PersistentForwardGpu, MatchesReferenceAndFeedsTheBackward) {
  const MoeShape shape = make_shape(257, 768, 256, 32, 8, 1, 128, 0.5f);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 77);
  problem.poison_outputs();
  reference::forward(problem.shape, problem.forward_args(0));
  reference::backward(problem.shape, problem.backward_args(0));
  DeviceProblem device(problem, 0);
  GpuLayer layer(shape, persistent_config(LocalDispatch::kProducerWarps, 256));
  const HostRank got = test::gpu_step(layer, device, problem, /*with_context=*/true);
  test::expect_near_reference(got, problem.ranks[0]);
}

TEST(PersistentForwardGpu, FinishesWhileAnotherStreamHoldsMostSms) {
  const MoeShape shape = make_shape(1500, 1024, 512, 16, 4);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 91);
  DeviceProblem device(problem, 0);
  MoeConfig two_kernels;
  two_kernels.local_dispatch = LocalDispatch::kGatherKernel;
  GpuLayer reference_layer(shape, two_kernels);
  const std::vector<bf16> want = run_forward(reference_layer, device, problem);

  GpuLayer layer(shape, persistent_config(LocalDispatch::kProducerWarps, 512));
  run_forward(layer, device, problem);  // warm-up: kernel attributes, module load
  cudaStream_t layer_stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&layer_stream, cudaStreamNonBlocking), cudaSuccess);
  device.poison_outputs();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the memsets ran on the legacy stream
  {
    const test::SmHold hold(8, 2'000'000'000ull);  // the forward gets 8 SMs for 2 s
    layer.forward(device.forward_args(), layer_stream);
    const Status status = layer.synchronize(layer_stream);
    ASSERT_TRUE(status.ok()) << status.message;
    // The forward finished on the SMs left to it, before the hold let go of the others.
    EXPECT_TRUE(hold.still_held())
        << "the forward only finished after the SM-holding kernel exited";
  }
  HostRank result = output_buffers(problem.shape);
  device.download_outputs(result);
  EXPECT_TRUE(test::bitwise_equal(result.out, want));
  cudaStreamDestroy(layer_stream);
}

}  // namespace
}  // namespace mok
