// The single-GPU forward against the CPU reference: fresh random inputs, outputs poisoned before
// every run, relative error within bf16 tolerance, no NaN, bitwise identical across repeated
// runs; adversarial routings; bad expert ids reported through the schedule's error word.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "mok/gpu_layer.h"
#include "mok/reference.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "test_util.h"

namespace mok {
namespace {

using test::make_shape;

constexpr double kTolerance = 1e-2;  // relative error against the CPU reference (expect ~3e-3)

struct Case {
  const char* name;
  MoeShape shape;
  RoutingKind routing;
};

// Runs the GPU forward on `problem` (R = 1) and returns its output.
std::vector<bf16> gpu_forward(GpuLayer& layer, DeviceProblem& device, const HostProblem& problem) {
  device.poison_outputs();
  layer.forward(device.forward_args(), nullptr);
  Status status = layer.synchronize(nullptr);
  EXPECT_TRUE(status.ok()) << status.message;
  HostRank result = output_buffers(problem.shape);
  device.download_outputs(result);
  return result.out;
}

void check_case(const Case& test_case, uint64_t seed) {
  SCOPED_TRACE(std::string(test_case.name) + " " + test_case.shape.to_string() + " routing " +
               routing_kind_name(test_case.routing));
  HostProblem problem = HostProblem::make(test_case.shape, test_case.routing, seed);
  problem.poison_outputs();
  reference::forward(problem.shape, problem.forward_args(0));
  DeviceProblem device(problem, 0);
  GpuLayer layer(problem.shape, MoeConfig{});
  const std::vector<bf16> first = gpu_forward(layer, device, problem);
  const double error = test::relative_error(first, problem.ranks[0].out);
  EXPECT_TRUE(test::all_finite(first))
      << "NaN or Inf in the GPU output (poisoned elements not written?)";
  EXPECT_LE(error, kTolerance);
  std::printf("  %-22s %-36s %-10s rel err %.2e\n", test_case.name,
              test_case.shape.to_string().c_str(), routing_kind_name(test_case.routing), error);
  for (int repeat = 0; repeat < 3; ++repeat) {
    const std::vector<bf16> again = gpu_forward(layer, device, problem);
    ASSERT_TRUE(test::bitwise_equal(again, first))
        << "run " << repeat + 2 << " differs bitwise from run 1";
  }
}

TEST(ForwardGpu, MatchesReference) {
  const std::vector<Case> cases = {
      {"tiny", named_shape("tiny"), RoutingKind::kUniform},
      {"tiny shared+clamp", make_shape(64, 256, 128, 8, 2, 1, 192, 0.3f), RoutingKind::kUniform},
      {"one token", make_shape(1, 256, 128, 8, 2, 1, 64), RoutingKind::kUniform},
      {"medium holes", make_shape(333, 1024, 384, 16, 4), RoutingKind::kHoles},
      {"medium skewed", make_shape(333, 1024, 384, 16, 4, 1, 128), RoutingKind::kSkewed},
      {"all to one expert", make_shape(200, 512, 256, 8, 4), RoutingKind::kOneExpert},
      {"no routes", make_shape(130, 512, 256, 8, 4, 1, 64), RoutingKind::kNoRoutes},
      {"no routes no shared", make_shape(130, 512, 256, 8, 4), RoutingKind::kNoRoutes},
      {"zero tokens", make_shape(0, 512, 256, 8, 4, 1, 64), RoutingKind::kUniform},
      {"large K", make_shape(257, 768, 256, 64, 8), RoutingKind::kUniform},
      // More than the combine's eight rows in flight: a second round of rows, with holes.
      {"top 10 with holes", make_shape(200, 768, 256, 16, 10, 1, 128), RoutingKind::kHoles},
  };
  uint64_t seed = 100;
  for (const Case& test_case : cases) check_case(test_case, ++seed);
}

TEST(ForwardGpu, FreshInputsEachRun) {
  const MoeShape shape = make_shape(300, 1024, 512, 8, 2, 1, 256, 1.0f);
  for (uint64_t seed : {7, 8, 9}) check_case({"fresh", shape, RoutingKind::kUniform}, seed);
}

// Every way of the local dispatch (its own kernel, the GEMM's producer warps, the producer
// warp's one-row TMA loads) gives the same bits, on every routing, across repeated launches
// (the producer-warps counters carry epochs, nothing is reset).
TEST(ForwardGpu, LocalDispatchModesAreBitwiseEqual) {
  for (RoutingKind routing : {RoutingKind::kUniform, RoutingKind::kOneExpert, RoutingKind::kHoles,
                              RoutingKind::kNoRoutes, RoutingKind::kSkewed}) {
    SCOPED_TRACE(routing_kind_name(routing));
    const MoeShape shape = make_shape(333, 1024, 384, 16, 4, 1, 128);
    HostProblem problem = HostProblem::make(shape, routing, 31);
    DeviceProblem device(problem, 0);
    MoeConfig plain_config;
    plain_config.local_dispatch = LocalDispatch::kGatherKernel;
    GpuLayer plain(shape, plain_config);
    const std::vector<bf16> want = gpu_forward(plain, device, problem);
    for (LocalDispatch mode : {LocalDispatch::kProducerWarps}) {
      SCOPED_TRACE(local_dispatch_name(mode));
      MoeConfig config;
      config.local_dispatch = mode;
      GpuLayer layer(shape, config);
      for (int repeat = 0; repeat < 3; ++repeat)
        EXPECT_TRUE(test::bitwise_equal(gpu_forward(layer, device, problem), want))
            << "launch " << repeat;
    }
  }
}

// The whole forward captured once in a CUDA graph and replayed with new routing contents: the
// schedule and the fused dispatch's epochs live in device memory, so every replay is a fresh,
// correct forward.
// Parameters: the local dispatch mode, and how the GEMMs run: two kernels, the persistent kernel,
// or two kernels with every launch overlapped (MoeConfig::overlap_kernel_launches: the graph then
// holds programmatic edges).
enum class ForwardKernels { kTwo, kPersistent, kTwoOverlapped };
class ForwardGraphReplay
    : public testing::TestWithParam<std::tuple<LocalDispatch, ForwardKernels>> {};

TEST_P(ForwardGraphReplay, NewRoutingEachReplay) {
  const MoeShape shape = make_shape(300, 512, 256, 16, 4, 1, 128);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 21);
  DeviceProblem device(problem, 0);
  MoeConfig config;
  // The producer warps' and the persistent kernel's epochs must survive replays.
  config.local_dispatch = std::get<0>(GetParam());
  config.persistent_forward = std::get<1>(GetParam()) == ForwardKernels::kPersistent;
  config.overlap_kernel_launches = std::get<1>(GetParam()) == ForwardKernels::kTwoOverlapped;
  config.wait_timeout_s = 10;
  GpuLayer layer(shape, config);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  layer.forward(device.forward_args(),
                stream);  // first call sets kernel attributes outside capture
  ASSERT_TRUE(layer.synchronize(stream).ok());
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  layer.forward(device.forward_args(), stream);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (RoutingKind routing : {RoutingKind::kSkewed, RoutingKind::kHoles, RoutingKind::kUniform}) {
    SCOPED_TRACE(routing_kind_name(routing));
    HostProblem next = problem;
    next.ranks[0].top_experts = generate_routing(routing, 1, 300, 4, 16, 77);
    next.poison_outputs();
    reference::forward(next.shape, next.forward_args(0));
    device.upload_routing(next.ranks[0].top_experts);
    device.poison_outputs();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the memsets ran on the legacy stream
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_TRUE(layer.synchronize(stream).ok());
    HostRank got = next.ranks[0];
    device.download_outputs(got);
    EXPECT_TRUE(test::all_finite(got.out));
    EXPECT_LE(test::relative_error(got.out, next.ranks[0].out), kTolerance);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

INSTANTIATE_TEST_SUITE_P(
    LocalDispatch, ForwardGraphReplay,
    testing::Combine(testing::Values(LocalDispatch::kGatherKernel, LocalDispatch::kProducerWarps),
                     testing::Values(ForwardKernels::kTwo, ForwardKernels::kPersistent,
                                     ForwardKernels::kTwoOverlapped)),
    [](const testing::TestParamInfo<std::tuple<LocalDispatch, ForwardKernels>>& info) {
      std::string name = local_dispatch_name(std::get<0>(info.param));
      for (char& c : name)
        if (c == '-') c = '_';
      switch (std::get<1>(info.param)) {
        case ForwardKernels::kTwo:
          return name + "_two_kernels";
        case ForwardKernels::kPersistent:
          return name + "_persistent";
        case ForwardKernels::kTwoOverlapped:
          break;
      }
      return name + "_two_kernels_overlapped";
    });

TEST(ForwardGpu, BadExpertIdIsReportedAtSynchronize) {
  const MoeShape shape = named_shape("tiny");
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 5);
  problem.ranks[0].top_experts[2 * shape.top_k + 1] = static_cast<int32_t>(shape.num_experts + 3);
  DeviceProblem device(problem, 0);
  GpuLayer layer(shape, MoeConfig{});
  layer.forward(device.forward_args(), nullptr);
  const Status status = layer.synchronize(nullptr);
  EXPECT_EQ(status.code, ErrorCode::kDeviceFault);
  EXPECT_NE(status.message.find("top_experts[rank 0, token 2, k 1] = 11 is out of range"),
            std::string::npos)
      << status.message;
}

TEST(ForwardGpu, RejectsHostTensorsBeforeLaunching) {
  const MoeShape shape = named_shape("tiny");
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 5);
  GpuLayer layer(shape, MoeConfig{});
  try {
    layer.forward(problem.forward_args(0), nullptr);
    FAIL() << "CPU tensors were accepted";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("`x` is on cpu; expected a cuda tensor"),
              std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace mok
