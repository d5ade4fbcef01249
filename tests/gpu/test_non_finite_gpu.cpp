// NaN and infinities on the GPU (docs/design.md, "Non-finite values"): one value at a time in x,
// a routed and the shared expert's weights, d_out and the router weights, on several shapes and
// routings (a token routed twice to one expert, a -1 slot, everything to one expert); every
// output of a training step holds NaN and +-inf exactly where the CPU reference's do, element
// for element, with its finite elements within bf16 tolerance; every path gives the same bits
// (the kernel sequences, both persistent kernels, the macrobatch ring with its recompute, the
// gather kernel, with and without the forward context). Then MoeConfig::check_finite.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "device_memory.h"
#include "gpu_step.h"
#include "kernels/stages/non_finite_scan.h"
#include "mok/gpu_layer.h"
#include "mok/reference.h"
#include "mok/testing/device_problem.h"
#include "mok/testing/host_problem.h"
#include "non_finite.h"
#include "test_util.h"

namespace mok {
namespace {

using test::make_shape;
using test::NonFiniteSite;

constexpr double kTolerance = 1e-2;

struct Case {
  const char* name;
  MoeShape shape;
  RoutingKind routing;
};

// The layer's paths: each must give the bits of the first.
std::vector<std::pair<const char*, MoeConfig>> configs() {
  std::vector<std::pair<const char*, MoeConfig>> all(3);
  all[0].first = "kernel sequences";
  all[1].first = "persistent forward + backward";
  all[1].second.persistent_forward = true;
  all[1].second.persistent_backward = true;
  all[1].second.minibatch_size = 256;
  all[2].first = "gather kernel + macrobatch ring + persistent forward";
  all[2].second.local_dispatch = LocalDispatch::kGatherKernel;
  all[2].second.persistent_forward = true;
  all[2].second.minibatch_size = 128;
  all[2].second.macrobatch_size = 256;
  return all;
}

void check_case(const Case& c, uint64_t& seed) {
  std::vector<std::unique_ptr<GpuLayer>> layers;
  for (const auto& [name, config] : configs())
    layers.push_back(std::make_unique<GpuLayer>(c.shape, config));
  for (NonFiniteSite site : test::non_finite_sites(c.shape)) {
    for (float value : test::non_finite_values()) {
      HostProblem problem = HostProblem::make(c.shape, c.routing, ++seed);
      test::add_duplicate_route_and_hole(problem);
      const std::string label = std::string(c.name) + ", " + std::to_string(value) + " in " +
                                test::place_non_finite(problem, site, value);
      SCOPED_TRACE(label);
      test::run_reference(problem);
      const HostRank& want = problem.ranks[0];
      DeviceProblem device(problem, 0);
      const HostRank first = test::gpu_step(*layers[0], device, problem, /*with_context=*/true);
      int64_t non_finite = 0;
      test::for_each_output(first, want, [&](const char* output, const auto& a, const auto& b) {
        if (!b.empty())
          non_finite += test::expect_same_pattern(label + ": " + output, a, b, kTolerance);
      });
      if (site == NonFiniteSite::kUnroutedRouterWeight)
        EXPECT_EQ(non_finite, 0) << "a -1 slot's router weight is read by nothing";
      else
        EXPECT_GT(non_finite, 0);
      for (size_t i = 0; i < layers.size(); ++i)
        for (const bool with_context : {true, false}) {
          if (i == 0 && with_context) continue;
          const HostRank again = test::gpu_step(*layers[i], device, problem, with_context);
          test::for_each_output(again, first,
                                [&](const char* output, const auto& a, const auto& b) {
                                  EXPECT_TRUE(test::bitwise_equal(a, b))
                                      << output << " differs bitwise with " << configs()[i].first
                                      << (with_context ? "" : " (recomputing the forward)")
                                      << " at element " << test::first_difference(a, b);
                                });
        }
    }
  }
  std::printf("  %-34s %-44s %-10s: every site and value matches the reference's pattern\n", c.name,
              c.shape.to_string().c_str(), routing_kind_name(c.routing));
}

TEST(NonFiniteGpu, PatternsMatchTheReferenceOnEveryPath) {
  uint64_t seed = 5100;
  // The case (8 experts, top-2, H = 1024, I = 256), the clamp with a shared expert and
  // tokens not a multiple of the tile, -1 holes, everything to one expert (every token twice).
  check_case({"top-2 of 8", make_shape(96, 1024, 256, 8, 2), RoutingKind::kUniform}, seed);
  check_case({"shared + clamp, skewed", make_shape(333, 512, 384, 16, 4, 1, 128, 0.5f),
              RoutingKind::kSkewed},
             seed);
  check_case({"holes, shared", make_shape(200, 256, 128, 8, 4, 1, 192), RoutingKind::kHoles}, seed);
  check_case({"all to one expert", make_shape(130, 256, 128, 4, 2), RoutingKind::kOneExpert}, seed);
}

// The report, as it saw it: one NaN in one token's x, and the two experts the token
// routes to get weight gradients that are NaN throughout (the reference's), not finite garbage.
TEST(NonFiniteGpu, NanInOneTokenMakesItsExpertsGradientsNanThroughout) {
  const MoeShape shape = make_shape(64, 1024, 256, 8, 2);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 5200);
  const int64_t token = 5, H = shape.hidden, matrix = shape.intermediate * H;
  problem.ranks[0].x[token * H + 17] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  DeviceProblem device(problem, 0);
  GpuLayer layer(shape, MoeConfig{});
  const HostRank got = test::gpu_step(layer, device, problem, /*with_context=*/true);
  const int32_t first = problem.ranks[0].top_experts[token * 2];
  const int32_t second = problem.ranks[0].top_experts[token * 2 + 1];
  for (int64_t e = 0; e < shape.num_experts; ++e) {
    const bool hit = e == first || e == second;
    int64_t index = 0;
    for (const auto* grads : {&got.d_w_gate, &got.d_w_up, &got.d_w_down}) {
      int64_t nan = 0;
      for (int64_t i = 0; i < matrix; ++i)
        nan += std::isnan(bf16_to_float((*grads)[e * matrix + i]));
      EXPECT_EQ(nan, hit ? matrix : 0) << (index == 0   ? "d_w_gate"
                                           : index == 1 ? "d_w_up"
                                                        : "d_w_down")
                                       << " of expert " << e;
      ++index;
    }
  }
}

// Padding rows (each expert's segment is padded to the 128-row tile) add exact zeros to the
// expert's weight gradients whatever its weights hold. With one routed row, an infinite up or
// down weight makes the expert's d_w_gate row +-inf in the reference (one product per element);
// a padding row computed from the math would add 0 * inf = NaN to it.
TEST(NonFiniteGpu, PaddingRowsAddExactZerosToWeightGradients) {
  const MoeShape shape = make_shape(16, 256, 128, 8, 2);
  const int64_t H = shape.hidden, I = shape.intermediate, expert = 3;
  HostProblem base = HostProblem::make(shape, RoutingKind::kUniform, 5250);
  for (int32_t& route : base.ranks[0].top_experts)
    if (route == expert) route = expert + 1;
  base.ranks[0].top_experts[0] = expert;  // token 0, slot 0: the expert's only row
  MoeConfig persistent;
  persistent.persistent_backward = true;
  GpuLayer sequence_layer(shape, MoeConfig{}), persistent_layer(shape, persistent);
  const float inf = std::numeric_limits<float>::infinity();
  for (const auto& [name, index, weights] :
       {std::tuple{"w_up", (expert * I + 5) * H + 9, &HostRank::w_up},
        std::tuple{"w_down", (expert * H + 2) * I + 7, &HostRank::w_down}}) {
    SCOPED_TRACE(name);
    HostProblem problem = base;
    (problem.ranks[0].*weights)[static_cast<size_t>(index)] = float_to_bf16(inf);
    test::run_reference(problem);
    const HostRank& want = problem.ranks[0];
    int64_t infinite = 0;
    for (int64_t i = 0; i < I * H; ++i)
      infinite += std::isinf(bf16_to_float(want.d_w_gate[expert * I * H + i]));
    ASSERT_GT(infinite, 0) << "the case must give the reference infinite weight gradients";
    DeviceProblem device(problem, 0);
    for (GpuLayer* layer : {&sequence_layer, &persistent_layer}) {
      const HostRank got = test::gpu_step(*layer, device, problem, /*with_context=*/true);
      test::for_each_output(got, want, [&](const char* output, const auto& a, const auto& b) {
        if (!b.empty())
          test::expect_same_pattern(std::string(name) + " +inf: " + output, a, b, kTolerance);
      });
    }
  }
}

// One training step with MoeConfig::check_finite; returns what synchronize reported.
Status checked_step(GpuLayer& layer, DeviceProblem& device, bool with_context) {
  const ForwardContext context = layer.forward(device.forward_args(), nullptr);
  layer.backward(device.backward_args(), nullptr, with_context ? &context : nullptr);
  return layer.synchronize(nullptr);
}

// check_finite names the first non-finite input (tensor order x, router_weights, weights,
// d_out; then element order) at synchronize, ignores a -1 slot's router weight, and starts
// afresh after each synchronize.
TEST(NonFiniteGpu, CheckFiniteReportsTheFirstNonFiniteInput) {
  const MoeShape shape = make_shape(200, 512, 256, 8, 4, 1, 128);
  const int64_t H = shape.hidden, I = shape.intermediate;
  MoeConfig config;
  config.check_finite = true;
  GpuLayer layer(shape, config);
  const HostProblem clean = HostProblem::make(shape, RoutingKind::kUniform, 5300);
  {
    HostProblem problem = clean;
    test::add_duplicate_route_and_hole(problem);
    DeviceProblem device(problem, 0);
    const Status status = checked_step(layer, device, true);
    EXPECT_TRUE(status.ok()) << status.message;
  }
  struct Expected {
    NonFiniteSite site;
    float value;
    std::string message;
  };
  HostProblem probe = clean;
  test::add_duplicate_route_and_hole(probe);
  const int64_t expert = probe.ranks[0].top_experts[1 * shape.top_k];
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<Expected> expected = {
      {NonFiniteSite::kX, nan, "x[token 1, column " + std::to_string(H / 3) + "] = nan"},
      {NonFiniteSite::kRouterWeight, inf, "router_weights[token 1, k 1] = +inf"},
      {NonFiniteSite::kRoutedDown, -inf,
       "w_down[expert " + std::to_string(expert) + ", row 5, column " + std::to_string(I - 2) +
           "] = -inf"},
      {NonFiniteSite::kSharedUp, nan,
       "w_shared_up[row 127, column " + std::to_string(H / 2) + "] = nan"},
      {NonFiniteSite::kDOut, -inf, "d_out[token 2, column 0] = -inf"},
  };
  for (const Expected& e : expected) {
    for (const bool with_context : {true, false}) {
      HostProblem problem = probe;
      test::place_non_finite(problem, e.site, e.value);
      DeviceProblem device(problem, 0);
      const Status status = checked_step(layer, device, with_context);
      EXPECT_EQ(status.code, ErrorCode::kDeviceFault) << e.message;
      EXPECT_NE(status.message.find("check_finite: " + e.message + " is not finite"),
                std::string::npos)
          << status.message;
    }
  }
  // Two at once: x comes first in the order, whatever else is bad.
  HostProblem both = probe;
  test::place_non_finite(both, NonFiniteSite::kRoutedGate, nan);
  test::place_non_finite(both, NonFiniteSite::kX, inf);
  DeviceProblem both_device(both, 0);
  const Status first = checked_step(layer, both_device, true);
  EXPECT_NE(first.message.find("check_finite: x[token 1"), std::string::npos) << first.message;
  // A -1 slot's weight is never read, so it is not reported; nor is the last call's record.
  HostProblem unrouted = probe;
  test::place_non_finite(unrouted, NonFiniteSite::kUnroutedRouterWeight, nan);
  DeviceProblem unrouted_device(unrouted, 0);
  const Status quiet = checked_step(layer, unrouted_device, true);
  EXPECT_TRUE(quiet.ok()) << quiet.message;
}

// The scan at dsv3_local's size (x, router weights, 3 x 32 experts of 2048 x 7168 weights: 2.9
// GB): its read bandwidth, and the last element of w_down found when it alone is NaN (indices
// past 2^28, the second-to-last tensor of the order).
TEST(NonFiniteGpu, ScanReadsAtMemoryBandwidth) {
  const MoeShape shape = named_shape("dsv3_local");
  const int64_t weights = shape.num_experts * shape.intermediate * shape.hidden;
  const int64_t tokens = shape.num_tokens * shape.hidden, slots = shape.num_tokens * shape.top_k;
  test::DeviceAllocations memory;
  auto buffer = [&](int64_t bytes, int fill) {
    void* pointer = memory.allocate(static_cast<size_t>(bytes));
    EXPECT_EQ(cudaMemset(pointer, fill, static_cast<size_t>(bytes)), cudaSuccess);  // 0x3e3e: 0.186
    return pointer;
  };
  kernels::NonFiniteScan scan;
  auto add = [&](kernels::ScannedTensor id, void* data, int64_t count) {
    kernels::ScanTensor& tensor = scan.tensors[scan.num_tensors++];
    tensor.data = data;
    tensor.count = count;
    tensor.id = id;
  };
  add(kernels::ScannedTensor::kX, buffer(tokens * 2, 0x3e), tokens);
  add(kernels::ScannedTensor::kRouterWeights, buffer(slots * 4, 0x3e), slots);
  scan.tensors[1].routes = buffer(slots * 4, 0);  // every slot routed to expert 0
  scan.tensors[1].num_experts = static_cast<int32_t>(shape.num_experts);
  void* w_down = nullptr;
  for (kernels::ScannedTensor id : {kernels::ScannedTensor::kWGate, kernels::ScannedTensor::kWUp,
                                    kernels::ScannedTensor::kWDown}) {
    void* data = buffer(weights * 2, 0x3e);
    add(id, data, weights);
    w_down = data;
  }
  unsigned long long* record = static_cast<unsigned long long*>(buffer(8, 0xff));
  int sm_count = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const test::TimingEvents events;
  std::vector<float> times;
  for (int i = 0; i < 23; ++i) {
    ASSERT_EQ(cudaEventRecord(events.start, nullptr), cudaSuccess);
    ASSERT_EQ(kernels::launch_non_finite_scan(scan, record, sm_count, nullptr), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(events.stop, nullptr), cudaSuccess);
    ASSERT_EQ(cudaEventSynchronize(events.stop), cudaSuccess);
    float ms = 0;
    ASSERT_EQ(cudaEventElapsedTime(&ms, events.start, events.stop), cudaSuccess);
    if (i >= 3) times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  const double bytes = 3.0 * weights * 2 + tokens * 2 + slots * 8;
  const double ms = times[times.size() / 2];
  std::printf(
      "  check_finite scan of dsv3_local's forward inputs: %.1f MB in %.3f ms = %.2f TB/s\n",
      bytes / 1e6, ms, bytes / ms / 1e9);
  unsigned long long found = 0;
  ASSERT_EQ(cudaMemcpy(&found, record, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(found, kernels::kNoNonFinite) << "finite inputs reported";
  const uint16_t nan_bits = 0x7fc0;
  ASSERT_EQ(cudaMemcpy(static_cast<uint16_t*>(w_down) + weights - 1, &nan_bits, 2,
                       cudaMemcpyHostToDevice),
            cudaSuccess);
  ASSERT_EQ(kernels::launch_non_finite_scan(scan, record, sm_count, nullptr), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(&found, record, 8, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(found, kernels::non_finite_key(kernels::ScannedTensor::kWDown, weights - 1,
                                           kernels::NonFiniteKind::kNaN));
}

}  // namespace
}  // namespace mok
