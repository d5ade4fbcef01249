// FP8's weight gradients in their other forms on the CPU reference (BackwardArgs: d_w_* in fp32,
// accumulate_weight_grads): written in fp32 they are the sums the bf16 run rounds, and
// accumulated they are round(old + sum) in each matrix's own dtype, bit for bit, with a shared
// expert and experts without rows, on one rank and on each rank of a two-rank group; every other
// output keeps the bf16 run's bits. The calls
// refuse them, by name, where they do not apply: a bf16 layer, frozen weights, other dtypes.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "mok/error.h"
#include "mok/reference.h"
#include "mok/testing/host_problem.h"
#include "test_util.h"
#include "weight_grad_forms.h"

namespace mok {
namespace {

using test::GradValues;
using test::kNumWeightGrads;

reference::Options fp8_options() {
  reference::Options options;
  options.precision = Precision::kFP8Block;
  return options;
}

// The reference's backward with each weight gradient in `grads` (dtype and values as given).
HostRank backward_into(const MoeShape& shape, RoutingKind routing, uint64_t seed,
                       std::vector<GradValues>& grads, bool accumulate) {
  HostProblem problem = HostProblem::make(shape, routing, seed);
  problem.poison_outputs();
  BackwardArgs args = problem.backward_args(0);
  for (int g = 0; g < kNumWeightGrads; ++g) {
    *test::weight_grad_view(args, g) = test::dense_view(
        grads[g].data(), grads[g].dtype, test::weight_grad_dims(shape, g), DeviceType::kCPU);
  }
  args.accumulate_weight_grads = accumulate;
  reference::backward(shape, args, fp8_options());
  return problem.ranks[0];
}

int64_t count_of(const MoeShape& shape, int g) {
  int64_t count = 1;
  for (const int64_t d : test::weight_grad_dims(shape, g)) count *= d;
  return test::weight_grad_dims(shape, g).empty() ? 0 : count;
}

TEST(Fp8WeightGradForms, Fp32AndAccumulatedOnTheReference) {
  const MoeShape shape = test::make_shape(150, 256, 128, 6, 2, 1, 128);
  for (const RoutingKind routing : {RoutingKind::kSkewed, RoutingKind::kHoles}) {
    SCOPED_TRACE(routing_kind_name(routing));
    HostProblem want = HostProblem::make(shape, routing, 11);
    reference::backward(shape, want.backward_args(0), fp8_options());

    std::vector<GradValues> sums;
    for (int g = 0; g < kNumWeightGrads; ++g)
      sums.emplace_back(DType::kFloat32, count_of(shape, g));
    const HostRank fp32_run = backward_into(shape, routing, 11, sums, false);
    for (int g = 0; g < kNumWeightGrads; ++g)
      test::expect_rounds_to(sums[g], test::weight_grad_of(want.ranks[0], g),
                             test::kWeightGradNames[g]);
    EXPECT_TRUE(test::bitwise_equal(fp32_run.d_x, want.ranks[0].d_x));
    EXPECT_TRUE(test::bitwise_equal(fp32_run.d_router_weights, want.ranks[0].d_router_weights));

    // Accumulated, the matrices alternating fp32 and bf16.
    std::vector<GradValues> old, got;
    for (int g = 0; g < kNumWeightGrads; ++g) {
      const DType dtype = g % 2 == 0 ? DType::kFloat32 : DType::kBFloat16;
      old.push_back(test::random_old_values(dtype, count_of(shape, g), 40 + g));
      got.push_back(old.back());
    }
    const HostRank accumulated = backward_into(shape, routing, 11, got, true);
    for (int g = 0; g < kNumWeightGrads; ++g)
      test::expect_accumulated(got[g], old[g], sums[g],
                               std::string(test::kWeightGradNames[g]) + " accumulated");
    EXPECT_TRUE(test::bitwise_equal(accumulated.d_x, want.ranks[0].d_x));
  }
}

// Expert parallel (the reference's two-rank emulation): every rank's fp32 gradients round to the
// plain run's, and accumulated they are round(old + sum), bit for bit.
TEST(Fp8WeightGradForms, Fp32AndAccumulatedOnEveryRankOfAGroup) {
  const MoeShape shape = test::make_shape(128, 256, 128, 8, 3, 2, 128);
  HostProblem want = HostProblem::make(shape, RoutingKind::kSkewed, 13);
  reference::backward_ep(shape, want.all_backward_args(), fp8_options());
  // One group's backward with rank r's gradients in grads[r].
  auto run = [&](std::vector<std::vector<GradValues>>& grads, bool accumulate) {
    HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 13);
    std::vector<BackwardArgs> args = problem.all_backward_args();
    for (int32_t rank = 0; rank < shape.num_ranks; ++rank) {
      for (int g = 0; g < kNumWeightGrads; ++g)
        *test::weight_grad_view(args[rank], g) =
            test::dense_view(grads[rank][g].data(), grads[rank][g].dtype,
                             test::weight_grad_dims(shape, g), DeviceType::kCPU);
      args[rank].accumulate_weight_grads = accumulate;
    }
    reference::backward_ep(shape, args, fp8_options());
  };
  std::vector<std::vector<GradValues>> sums(shape.num_ranks), old(shape.num_ranks);
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank)
    for (int g = 0; g < kNumWeightGrads; ++g) {
      sums[rank].emplace_back(DType::kFloat32, count_of(shape, g));
      old[rank].push_back(
          test::random_old_values(DType::kFloat32, count_of(shape, g), 60 + 8 * rank + g));
    }
  run(sums, false);
  std::vector<std::vector<GradValues>> got = old;
  run(got, true);
  for (int32_t rank = 0; rank < shape.num_ranks; ++rank)
    for (int g = 0; g < kNumWeightGrads; ++g) {
      const std::string what = "rank " + std::to_string(rank) + " " + test::kWeightGradNames[g];
      test::expect_rounds_to(sums[rank][g], test::weight_grad_of(want.ranks[rank], g), what);
      test::expect_accumulated(got[rank][g], old[rank][g], sums[rank][g], what + " accumulated");
    }
}

TEST(Fp8WeightGradForms, RefusedWhereTheyDoNotApply) {
  const MoeShape shape = test::make_shape(64, 256, 128, 4, 2);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 1);
  std::vector<float> fp32(static_cast<size_t>(count_of(shape, 0)));
  auto expect_refused = [&](const BackwardArgs& args, const reference::Options& options,
                            const char* fragment) {
    test::expect_invalid_argument([&] { reference::backward(shape, args, options); }, fragment);
  };
  BackwardArgs fp32_gate = problem.backward_args(0);
  fp32_gate.d_w_gate.data = fp32.data();
  fp32_gate.d_w_gate.dtype = DType::kFloat32;
  expect_refused(fp32_gate, reference::Options{}, "d_w_gate is fp32; the bf16 layer");
  BackwardArgs accumulate = problem.backward_args(0);
  accumulate.accumulate_weight_grads = true;
  expect_refused(accumulate, reference::Options{}, "accumulate_weight_grads is set; the bf16");
  BackwardArgs frozen = without_weight_gradients(problem.backward_args(0));
  frozen.accumulate_weight_grads = true;
  expect_refused(frozen, fp8_options(), "`accumulate_weight_grads` is set but the weight");
  BackwardArgs int32 = problem.backward_args(0);
  int32.d_w_down.dtype = DType::kInt32;
  expect_refused(int32, fp8_options(), "`d_w_down` has dtype int32; expected bf16 or fp32");
}

}  // namespace
}  // namespace mok
