// What the single-GPU layer tests share: one training step with the outputs poisoned first and
// downloaded after, and the check of every output against the CPU reference.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "mok/gpu_layer.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "test_util.h"

namespace mok::test {

// Forward, then backward from the forward's context, or recomputing the forward when
// `with_context` is false; every output downloaded (without `weight_gradients`, frozen weights:
// their buffers keep the poison).
inline HostRank gpu_step(GpuLayer& layer, DeviceProblem& device, const HostProblem& problem,
                         bool with_context, cudaStream_t stream = nullptr,
                         bool weight_gradients = true) {
  device.poison_outputs();
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the poison's memsets: the legacy stream
  const ForwardContext context = layer.forward(device.forward_args(), stream);
  const BackwardArgs args =
      weight_gradients ? device.backward_args() : without_weight_gradients(device.backward_args());
  layer.backward(args, stream, with_context ? &context : nullptr);
  const Status status = layer.synchronize(stream);
  EXPECT_TRUE(status.ok()) << status.message;
  HostRank result = output_buffers(problem.shape);
  device.download_outputs(result);
  return result;
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

}  // namespace mok::test
