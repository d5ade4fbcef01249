// NaN and infinities in the inputs (docs/design.md, "Non-finite values"): the CPU reference puts
// them in every output exactly where the independent double-precision oracle does, element for
// element, with the finite elements within the usual tolerance; its R-rank emulation gives the
// single-rank bits; and MoeConfig::check_finite's record orders and names what it found.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "kernels/stages/non_finite_scan.h"
#include "layer/non_finite_report.h"
#include "mok/reference.h"
#include "mok/testing/host_problem.h"
#include "mok/testing/routing.h"
#include "non_finite.h"
#include "test_util.h"

namespace mok {
namespace {

using test::make_shape;
using test::NonFiniteSite;

struct Case {
  const char* name;
  MoeShape shape;
  RoutingKind routing;
};

std::vector<Case> cases() {
  return {
      {"no clamp", make_shape(48, 256, 128, 8, 2), RoutingKind::kUniform},
      {"shared + clamp", make_shape(40, 128, 64, 8, 3, 1, 128, 0.4f), RoutingKind::kSkewed},
      {"holes, tokens not a tile multiple", make_shape(37, 128, 192, 4, 4, 1, 64),
       RoutingKind::kHoles},
  };
}

// Every output of the reference against the rounded oracle, pattern and finite values; returns
// the number of non-finite elements over all outputs.
int64_t expect_reference_matches_oracle(const std::string& label, const HostProblem& problem) {
  const oracle::Outputs want =
      oracle::run(problem.shape, problem.to_oracle_inputs(), /*round_like_kernel=*/true);
  const HostRank& got = problem.ranks[0];
  int64_t non_finite = 0;
  auto check = [&](const char* output, const auto& a, const std::vector<double>& b) {
    non_finite += test::expect_same_pattern(label + ": " + output, a, b, 5e-3);
  };
  check("out", got.out, want.out);
  check("d_x", got.d_x, want.d_x);
  check("d_router_weights", got.d_router_weights, want.d_router_weights);
  check("d_w_gate", got.d_w_gate, want.d_w_gate);
  check("d_w_up", got.d_w_up, want.d_w_up);
  check("d_w_down", got.d_w_down, want.d_w_down);
  check("d_w_shared_gate", got.d_w_shared_gate, want.d_w_shared_gate);
  check("d_w_shared_up", got.d_w_shared_up, want.d_w_shared_up);
  check("d_w_shared_down", got.d_w_shared_down, want.d_w_shared_down);
  return non_finite;
}

// One value at one place, every output checked: NaN, +inf and -inf in x, a routed and the
// shared expert's weights, d_out and a router weight, on shapes with and without the clamp and
// a shared expert, with a token routed twice to one expert and a -1 slot. A value in a -1
// slot's router weight reaches nothing; every other place makes some output non-finite.
TEST(NonFiniteReference, PatternsMatchTheOracleElementForElement) {
  uint64_t seed = 4100;
  for (const Case& c : cases()) {
    for (NonFiniteSite site : test::non_finite_sites(c.shape)) {
      for (float value : test::non_finite_values()) {
        HostProblem problem = HostProblem::make(c.shape, c.routing, ++seed);
        test::add_duplicate_route_and_hole(problem);
        const std::string where = test::place_non_finite(problem, site, value);
        const std::string label =
            std::string(c.name) + ", " + std::to_string(value) + " in " + where;
        SCOPED_TRACE(label);
        test::run_reference(problem, 2);
        const int64_t non_finite = expect_reference_matches_oracle(label, problem);
        if (site == NonFiniteSite::kUnroutedRouterWeight)
          EXPECT_EQ(non_finite, 0) << "a -1 slot's router weight is read by nothing";
        else
          EXPECT_GT(non_finite, 0) << "a non-finite input must reach some output";
      }
    }
  }
}

// The case the issue reported from the GPU (8 experts, top-2): one NaN in one token's x makes
// every weight gradient of the two experts it routes to NaN throughout (each of their elements
// sums a term of that token's row) and leaves the other experts' finite.
TEST(NonFiniteReference, NanInOneTokenMakesItsExpertsGradientsNanThroughout) {
  const MoeShape shape = make_shape(64, 256, 128, 8, 2);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 4200);
  const int64_t token = 5, H = shape.hidden, matrix = shape.intermediate * H;
  problem.ranks[0].x[token * H + 17] = float_to_bf16(std::numeric_limits<float>::quiet_NaN());
  test::run_reference(problem, 2);
  const HostRank& rank = problem.ranks[0];
  const int32_t first = rank.top_experts[token * 2], second = rank.top_experts[token * 2 + 1];
  for (int64_t e = 0; e < shape.num_experts; ++e) {
    const bool hit = e == first || e == second;
    for (const auto* grads : {&rank.d_w_gate, &rank.d_w_up, &rank.d_w_down}) {
      int64_t nan = 0;
      for (int64_t i = 0; i < matrix; ++i)
        nan += std::isnan(bf16_to_float((*grads)[e * matrix + i]));
      EXPECT_EQ(nan, hit ? matrix : 0) << "expert " << e;
    }
  }
  for (int64_t n = 0; n < H; ++n) {
    EXPECT_TRUE(std::isnan(bf16_to_float(rank.out[token * H + n])));
    EXPECT_TRUE(std::isnan(bf16_to_float(rank.d_x[token * H + n])));
  }
}

// The R-rank emulation with a non-finite input gives the single-rank bits (NaN payloads too).
TEST(NonFiniteReference, EpEmulationEqualsSingleRankBitwise) {
  for (int32_t ranks : {2, 4}) {
    const MoeShape shape = make_shape(24, 128, 64, 8, 3, ranks, 64, 0.5f);
    for (NonFiniteSite site : {NonFiniteSite::kX, NonFiniteSite::kRoutedDown,
                               NonFiniteSite::kSharedUp, NonFiniteSite::kRouterWeight}) {
      HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 4300 + ranks);
      test::add_duplicate_route_and_hole(problem);
      test::place_non_finite(problem, site, std::numeric_limits<float>::quiet_NaN());
      HostProblem single = problem.single_rank_equivalent();
      test::run_reference(problem, 2);
      test::run_reference(single, 2);
      SCOPED_TRACE(std::string("R = ") + std::to_string(ranks) + ", NaN in " +
                   test::non_finite_site_name(site));
      const int64_t T = shape.num_tokens, H = shape.hidden;
      const HostRank& mine = problem.ranks[0];
      const HostRank& all = single.ranks[0];
      EXPECT_TRUE(test::bitwise_equal(mine.out, test::slice(all.out, 0, T * H)));
      EXPECT_TRUE(test::bitwise_equal(mine.d_x, test::slice(all.d_x, 0, T * H)));
      const int64_t weights = shape.num_local_experts() * shape.intermediate * H;
      EXPECT_TRUE(test::bitwise_equal(mine.d_w_down, test::slice(all.d_w_down, 0, weights)));
      EXPECT_TRUE(test::bitwise_equal(mine.d_w_gate, test::slice(all.d_w_gate, 0, weights)));
    }
  }
}

// check_finite's record: a key orders by tensor, then element; decodes to what was encoded;
// and the message names the tensor, the element's coordinates and the value.
TEST(NonFiniteReport, KeysOrderByTensorThenElement) {
  using kernels::NonFiniteKind;
  using kernels::ScannedTensor;
  const unsigned long long x_late =
      kernels::non_finite_key(ScannedTensor::kX, 1000000, NonFiniteKind::kNaN);
  const unsigned long long weight_early =
      kernels::non_finite_key(ScannedTensor::kWGate, 0, NonFiniteKind::kNaN);
  const unsigned long long x_early =
      kernels::non_finite_key(ScannedTensor::kX, 3, NonFiniteKind::kNegativeInf);
  EXPECT_LT(x_late, weight_early);
  EXPECT_LT(x_early, x_late);
  EXPECT_LT(weight_early, kernels::kNoNonFinite);
  const int64_t big = (int64_t{1} << 40) + 12345;
  const unsigned long long key =
      kernels::non_finite_key(ScannedTensor::kDOut, big, NonFiniteKind::kPositiveInf);
  EXPECT_EQ(kernels::non_finite_tensor(key), ScannedTensor::kDOut);
  EXPECT_EQ(kernels::non_finite_index(key), big);
  EXPECT_EQ(kernels::non_finite_kind(key), NonFiniteKind::kPositiveInf);
}

TEST(NonFiniteReport, MessagesNameTensorCoordinatesAndValue) {
  using kernels::NonFiniteKind;
  using kernels::ScannedTensor;
  const MoeShape shape = make_shape(64, 256, 128, 8, 2, 1, 96);
  auto message = [&](const MoeShape& s, int32_t rank, ScannedTensor tensor, int64_t index,
                     NonFiniteKind kind) {
    return describe_non_finite(s, rank, kernels::non_finite_key(tensor, index, kind));
  };
  auto expect_contains = [](const std::string& text, const std::string& part) {
    EXPECT_NE(text.find(part), std::string::npos) << "'" << part << "' not in: " << text;
  };
  expect_contains(message(shape, 0, ScannedTensor::kX, 5 * 256 + 17, NonFiniteKind::kNaN),
                  "check_finite: x[token 5, column 17] = nan is not finite");
  expect_contains(
      message(shape, 0, ScannedTensor::kRouterWeights, 2 * 2 + 1, NonFiniteKind::kNegativeInf),
      "router_weights[token 2, k 1] = -inf");
  expect_contains(
      message(shape, 0, ScannedTensor::kWUp, (3 * 128 + 4) * 256 + 9, NonFiniteKind::kPositiveInf),
      "w_up[expert 3, row 4, column 9] = +inf");
  expect_contains(
      message(shape, 0, ScannedTensor::kWDown, (7 * 256 + 200) * 128 + 100, NonFiniteKind::kNaN),
      "w_down[expert 7, row 200, column 100] = nan");
  expect_contains(message(shape, 0, ScannedTensor::kWSharedDown, 10 * 96 + 95, NonFiniteKind::kNaN),
                  "w_shared_down[row 10, column 95]");
  expect_contains(message(shape, 0, ScannedTensor::kDOut, 63 * 256 + 255, NonFiniteKind::kNaN),
                  "d_out[token 63, column 255]");
  const MoeShape two_ranks = make_shape(64, 256, 128, 8, 2, 2);
  expect_contains(
      message(two_ranks, 1, ScannedTensor::kWGate, (2 * 128 + 1) * 256 + 3, NonFiniteKind::kNaN),
      "w_gate[local expert 2 = expert 6, row 1, column 3]");
}

// The scans a call launches: the forward's inputs in the record's order, the router weights
// with their routes; the backward's d_out, with the forward's inputs only when it recomputes.
TEST(NonFiniteReport, ScansCoverTheInputsOfEachCall) {
  const MoeShape shape = make_shape(16, 128, 64, 4, 2, 1, 64);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 4400);
  const BackwardArgs args = problem.backward_args(0);
  const kernels::NonFiniteScan forward = forward_input_scan(shape, args.forward);
  ASSERT_EQ(forward.num_tensors, 8);
  for (int i = 0; i < forward.num_tensors; ++i)
    EXPECT_EQ(static_cast<int>(forward.tensors[i].id), i);
  EXPECT_EQ(forward.tensors[1].count, shape.num_tokens * shape.top_k);
  EXPECT_EQ(forward.tensors[1].routes, args.forward.top_experts.data);
  EXPECT_EQ(forward.tensors[1].num_experts, shape.num_experts);
  EXPECT_EQ(forward.tensors[2].count, shape.num_experts * shape.intermediate * shape.hidden);
  const kernels::NonFiniteScan with_context = backward_input_scan(shape, args, false);
  ASSERT_EQ(with_context.num_tensors, 1);
  EXPECT_EQ(with_context.tensors[0].id, kernels::ScannedTensor::kDOut);
  EXPECT_EQ(backward_input_scan(shape, args, true).num_tensors, 9);
  const MoeShape routed_only = make_shape(16, 128, 64, 4, 2);
  HostProblem routed_problem = HostProblem::make(routed_only, RoutingKind::kUniform, 4401);
  EXPECT_EQ(forward_input_scan(routed_only, routed_problem.forward_args(0)).num_tensors, 5);
}

}  // namespace
}  // namespace mok
