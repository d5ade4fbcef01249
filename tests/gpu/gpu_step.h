// What the single-GPU layer tests share: one training step with the outputs poisoned first and
// downloaded after, and the check of every output against the CPU reference.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "mok/gpu_layer.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "test_util.h"

namespace mok::test {

// The launches of one step on `stream`, waited for on that stream alone: forward, then backward
// from the forward's context, or recomputing the forward when `with_context` is false (without
// `weight_gradients`, frozen weights: their buffers keep the poison). No device-wide
// synchronization, so it can run while another stream's kernel holds SMs; the caller poisons the
// outputs first.
inline Status launch_step(GpuLayer& layer, DeviceProblem& device, bool with_context,
                          cudaStream_t stream, bool weight_gradients = true) {
  const ForwardContext context = layer.forward(device.forward_args(), stream);
  const BackwardArgs args =
      weight_gradients ? device.backward_args() : without_weight_gradients(device.backward_args());
  layer.backward(args, stream, with_context ? &context : nullptr);
  return layer.synchronize(stream);
}

inline HostRank downloaded_outputs(DeviceProblem& device, const HostProblem& problem) {
  HostRank result = output_buffers(problem.shape);
  device.download_outputs(result);
  return result;
}

// One step (launch_step) with the outputs poisoned first and every output downloaded after.
inline HostRank gpu_step(GpuLayer& layer, DeviceProblem& device, const HostProblem& problem,
                         bool with_context, cudaStream_t stream = nullptr,
                         bool weight_gradients = true) {
  device.poison_outputs();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the poison's memsets: the legacy stream
  const Status status = launch_step(layer, device, with_context, stream, weight_gradients);
  EXPECT_TRUE(status.ok()) << status.message;
  return downloaded_outputs(device, problem);
}

// The output of one forward that keeps no context (ForwardArgs::keep_context false: no backward
// follows), the outputs poisoned first.
inline std::vector<bf16> forward_without_context(GpuLayer& layer, DeviceProblem& device,
                                                 const HostProblem& problem) {
  device.poison_outputs();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the poison's memsets: the legacy stream
  ForwardArgs args = device.forward_args();
  args.keep_context = false;
  layer.forward(args, nullptr);
  EXPECT_TRUE(layer.synchronize(nullptr).ok());
  return downloaded_outputs(device, problem).out;
}

// Every output the reference computed: finite, and within `tolerance` relative error.
inline void expect_near_reference(const HostRank& got, const HostRank& reference,
                                  double tolerance = 1e-2) {
  for_each_output(got, reference, [&](const char* output, const auto& a, const auto& b) {
    if (b.empty()) return;
    EXPECT_TRUE(all_finite(a)) << output;
    EXPECT_LE(relative_error(a, b), tolerance) << output;
  });
}

// Both layers' steps on `problem`, with and without the forward context, bit for bit (`what`
// names the variant in a failure).
inline void expect_same_steps(GpuLayer& want_layer, GpuLayer& got_layer, DeviceProblem& device,
                              const HostProblem& problem, const std::string& what = "") {
  for (const bool with_context : {true, false}) {
    const HostRank want = gpu_step(want_layer, device, problem, with_context);
    const HostRank got = gpu_step(got_layer, device, problem, with_context);
    for_each_output(got, want, [&](const char* output, const auto& a, const auto& b) {
      EXPECT_TRUE(bitwise_equal(a, b)) << output << what << (with_context ? "" : ", no context");
    });
  }
}

}  // namespace mok::test
