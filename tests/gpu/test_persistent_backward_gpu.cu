// The persistent backward kernel (MoeConfig::persistent_backward): against the CPU reference and
// bitwise against the kernel sequence on routings with empty experts, all rows on one expert and
// -1 slots, with and without the forward context, with a shared expert and the clamp; and it
// finishes while another stream holds all but 8 SMs (its tasks wait only on earlier tickets).
// BackwardGpu.BitwiseInvariantToConfig covers it across minibatch sizes too. Its task trace (and
// the persistent forward's) records every task.
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

MoeConfig persistent_backward_config(int64_t minibatch_size) {
  MoeConfig config;
  config.persistent_backward = true;
  config.minibatch_size = minibatch_size;
  config.wait_timeout_s = 10;
  return config;
}

TEST(PersistentBackwardGpu, MatchesReferenceAndTheKernelSequence) {
  uint64_t seed = 300;
  for (const auto& [name, shape, routing] :
       {std::tuple{"uniform, shared expert, clamp", make_shape(520, 1024, 512, 16, 4, 1, 256, 0.5f),
                   RoutingKind::kUniform},
        std::tuple{"one expert", make_shape(300, 512, 384, 8, 4), RoutingKind::kOneExpert},
        std::tuple{"holes", make_shape(333, 768, 256, 32, 8), RoutingKind::kHoles},
        std::tuple{"no routes", make_shape(130, 512, 256, 4, 4), RoutingKind::kNoRoutes}}) {
    SCOPED_TRACE(std::string(name) + " " + shape.to_string());
    HostProblem problem = HostProblem::make(shape, routing, ++seed);
    problem.poison_outputs();
    reference::forward(problem.shape, problem.forward_args(0));
    reference::backward(problem.shape, problem.backward_args(0));
    DeviceProblem device(problem, 0);
    GpuLayer sequence(shape, MoeConfig{});
    const HostRank want = test::gpu_step(sequence, device, problem, true);
    // Minibatches of 128 and 4096 rows.
    for (const int64_t minibatch : {128, 4096}) {
      GpuLayer layer(shape, persistent_backward_config(minibatch));
      for (const bool with_context : {true, false}) {
        SCOPED_TRACE(testing::Message()
                     << "minibatch " << minibatch << (with_context ? "" : ", no context"));
        const HostRank got = test::gpu_step(layer, device, problem, with_context);
        test::for_each_output(got, want, [&](const char* output, const auto& a, const auto& b) {
          EXPECT_TRUE(test::bitwise_equal(a, b)) << output << " differs from the kernel sequence";
        });
        test::expect_near_reference(got, problem.ranks[0]);
      }
    }
  }
}

// MoeConfig::trace_tasks: the same bits, and one event per task of the launch, each in order
// (taken, queued, started, finished), as many of each kind as the shape has tiles (the shared
// expert's in the persistent forward's stream too).
TEST(PersistentBackwardGpu, TaskTraceRecordsEveryTask) {
  const int64_t T = 700, H = 1024, I = 512, E = 8, K = 4, Is = 384;
  const MoeShape shape = make_shape(T, H, I, E, K, 1, Is);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 93);
  DeviceProblem device(problem, 0);
  GpuLayer sequence(shape, MoeConfig{});
  const HostRank want = test::gpu_step(sequence, device, problem, true);
  {
    MoeConfig config = persistent_backward_config(256);
    config.persistent_forward = true;
    config.trace_tasks = true;
    GpuLayer layer(shape, config);
    const HostRank got = test::gpu_step(layer, device, problem, true);
    test::for_each_output(got, want, [&](const char* output, const auto& a, const auto& b) {
      EXPECT_TRUE(test::bitwise_equal(a, b)) << output;
    });
    const std::vector<TaskTrace> traces = layer.task_traces(nullptr);
    ASSERT_EQ(traces.size(), 2u);
    // Row tiles: each expert's rows padded to 128.
    int64_t row_tiles = 0;
    std::vector<int64_t> expert_rows(E, 0);
    for (int32_t expert : problem.ranks[0].top_experts)
      if (expert >= 0) ++expert_rows[static_cast<size_t>(expert)];
    for (int64_t rows : expert_rows) row_tiles += (rows + 127) / 128;
    for (const TaskTrace& trace : traces) {
      SCOPED_TRACE(trace.kernel);
      std::vector<int64_t> per_kind(trace.kind_names.size(), 0);
      for (const TaskTraceEvent& event : trace.events) {
        if (event.kind < 0) continue;
        ASSERT_LT(event.kind, static_cast<int32_t>(per_kind.size()));
        ++per_kind[static_cast<size_t>(event.kind)];
        EXPECT_LE(event.ticket_ns, event.ready_ns);
        EXPECT_LE(event.ready_ns, event.start_ns);
        EXPECT_LE(event.start_ns, event.end_ns);
        EXPECT_NE(event.end_ns, ~0ull) << "a task started but never finished";
        EXPECT_GE(event.sm, 0);
      }
      if (trace.kernel == "persistent forward") {
        // gather, gate/up, down, combine, shared gate/up, shared down
        EXPECT_EQ(per_kind[1], row_tiles * (I / 128));
        EXPECT_EQ(per_kind[2], row_tiles * (H / 256));
        const int64_t shared_tiles = (T + 127) / 128;
        EXPECT_EQ(per_kind[4], shared_tiles * (Is / 128));
        EXPECT_EQ(per_kind[5], shared_tiles * (H / 256));
      } else {
        // rows, recompute, down dgrad, SwiGLU, gate/up dgrad, weight gradient, combine; then the
        // same kinds of the shared expert (every token a row, one expert)
        EXPECT_EQ(per_kind[0], 0);  // gathered before the launch or by the spare warps
        EXPECT_EQ(per_kind[1], 0);  // the forward context is used
        EXPECT_EQ(per_kind[2], row_tiles * (I / 256));
        EXPECT_EQ(per_kind[3], row_tiles);
        EXPECT_EQ(per_kind[4], row_tiles * (H / 256));
        EXPECT_EQ(per_kind[5], E * (2 * (I / 128) * (H / 256) + (H / 128) * (I / 256)));
        ASSERT_EQ(per_kind.size(), 14u);
        const int64_t shared_tiles = (T + 127) / 128, shared_inter_n = (Is + 255) / 256;
        EXPECT_EQ(per_kind[7], 0);  // its rows are the tokens: nothing to gather
        EXPECT_EQ(per_kind[8], 0);
        EXPECT_EQ(per_kind[9], shared_tiles * shared_inter_n);
        EXPECT_EQ(per_kind[10], shared_tiles);
        EXPECT_EQ(per_kind[11], shared_tiles * (H / 256));
        EXPECT_EQ(per_kind[12], 2 * (Is / 128) * (H / 256) + (H / 128) * shared_inter_n);
      }
      EXPECT_NE(summarize_task_trace(trace).find("SMs, span"), std::string::npos);
    }
  }
}

TEST(PersistentBackwardGpu, FinishesWhileAnotherStreamHoldsMostSms) {
  const MoeShape shape = make_shape(1500, 1024, 512, 16, 4);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 92);
  DeviceProblem device(problem, 0);
  GpuLayer sequence(shape, MoeConfig{});
  const HostRank want = test::gpu_step(sequence, device, problem, true);
  cudaStream_t layer_stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&layer_stream, cudaStreamNonBlocking), cudaSuccess);
  {
    GpuLayer layer(shape, persistent_backward_config(512));
    test::gpu_step(layer, device, problem, true);  // warm-up: kernel attributes, module load
    // The forward first, on all SMs; then the backward gets 8 SMs while the hold lasts.
    device.poison_outputs();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const ForwardContext context = layer.forward(device.forward_args(), layer_stream);
    ASSERT_EQ(cudaStreamSynchronize(layer_stream), cudaSuccess);
    {
      const test::SmHold hold(8, 3'000'000'000ull);
      layer.backward(device.backward_args(), layer_stream, &context);
      const Status status = layer.synchronize(layer_stream);
      ASSERT_TRUE(status.ok()) << status.message;
      EXPECT_TRUE(hold.still_held())
          << "the backward only finished after the SM-holding kernel exited";
    }
    test::for_each_output(test::downloaded_outputs(device, problem), want,
                          [&](const char* output, const auto& a, const auto& b) {
                            EXPECT_TRUE(test::bitwise_equal(a, b)) << output;
                          });
  }
  cudaStreamDestroy(layer_stream);
}

}  // namespace
}  // namespace mok
