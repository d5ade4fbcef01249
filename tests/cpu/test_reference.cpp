// The CPU reference against the double-precision oracle, the fixed-order dot product and NT
// product it is built on, determinism across thread counts and runs, and its input checks.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <ostream>
#include <stdexcept>
#include <string>
#include <vector>

#include "mok/reference.h"
#include "mok/testing/host_problem.h"
#include "mok/testing/routing.h"
#include "reference/gemm_f32.h"
#include "test_util.h"

namespace mok {
namespace {

using test::make_shape;
using test::relative_error;

constexpr float kNoClamp = std::numeric_limits<float>::infinity();

// ---------------------------------------------------------------------------------------------
// dot_fixed and gemm_nt.

// The documented order, spelled out with scalars.
float dot_by_definition(const float* a, const float* b, int64_t n) {
  float lanes[8] = {};
  for (int64_t i = 0; i < n; ++i) {
    const float product = a[i] * b[i];
    lanes[i % 8] = lanes[i % 8] + product;
  }
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

std::vector<float> random_floats(SplitMix64& rng, int64_t count) {
  std::vector<float> values(count);
  // Mixed magnitudes make the result sensitive to the summation order.
  for (float& value : values)
    value = static_cast<float>((2 * rng.uniform() - 1) * std::pow(10.0, 3 * rng.uniform() - 1));
  return values;
}

TEST(DotFixed, FollowsTheDocumentedLaneOrder) {
  SplitMix64 rng(7);
  for (int64_t n : {0, 1, 5, 8, 13, 64, 257, 1000}) {
    const std::vector<float> a = random_floats(rng, n), b = random_floats(rng, n);
    const float expected = dot_by_definition(a.data(), b.data(), n);
    const float actual = reference::dot_fixed(a.data(), b.data(), n);
    EXPECT_EQ(std::memcmp(&expected, &actual, sizeof(float)), 0) << "n = " << n;
  }
}

TEST(GemmNt, EveryElementIsTheFixedDot) {
  SplitMix64 rng(11);
  reference::ThreadPool pool(3);
  struct Size {
    int64_t rows, cols, depth;
  };
  // Edges of the 4x3 microkernel and 64x48 tile, depths around the 256 block and with tails.
  for (Size size : {Size{1, 1, 1}, Size{5, 7, 9}, Size{64, 48, 256}, Size{67, 50, 263},
                    Size{130, 97, 700}, Size{3, 2, 0}, Size{9, 100, 8}}) {
    const int64_t lda = size.depth + 3, ldb = size.depth + 5, ldc = size.cols + 2;
    const std::vector<float> a = random_floats(rng, size.rows * lda);
    const std::vector<float> b = random_floats(rng, size.cols * ldb);
    std::vector<float> c(size.rows * ldc, std::nanf(""));
    reference::gemm_nt(pool, size.rows, size.cols, size.depth, a.data(), lda, b.data(), ldb,
                       c.data(), ldc);
    int64_t mismatches = 0;
    for (int64_t i = 0; i < size.rows; ++i)
      for (int64_t j = 0; j < size.cols; ++j) {
        const float expected =
            dot_by_definition(a.data() + i * lda, b.data() + j * ldb, size.depth);
        mismatches += std::memcmp(&expected, &c[i * ldc + j], sizeof(float)) != 0;
      }
    EXPECT_EQ(mismatches, 0) << size.rows << "x" << size.cols << "x" << size.depth;
  }
}

TEST(ThreadPool, RunsEveryIndexOnceAndRethrows) {
  reference::ThreadPool pool(3);
  std::vector<int> hits(1001, 0);
  pool.parallel_for(1001, [&](int64_t i) { hits[i] += 1; });
  for (int hit : hits) ASSERT_EQ(hit, 1);
  EXPECT_THROW(pool.parallel_for(10,
                                 [](int64_t i) {
                                   if (i == 7) throw std::runtime_error("boom");
                                 }),
               std::runtime_error);
  pool.parallel_for(4, [&](int64_t i) { hits[i] = 5; });  // still usable after an exception
  EXPECT_EQ(hits[3], 5);
}

// ---------------------------------------------------------------------------------------------
// Reference vs oracle.

enum class RouterWeights { kRandom, kZeroAndNegative };

struct OracleCase {
  const char* name;
  MoeShape shape;
  RoutingKind routing;
  RouterWeights router_weights = RouterWeights::kRandom;
  bool expect_idle_expert = false;  // the routing leaves some expert without tokens
};

// Readable test names in failure messages instead of a byte dump.
void PrintTo(const OracleCase& value, std::ostream* os) {
  *os << value.name << " (" << value.shape.to_string() << ", routing "
      << routing_kind_name(value.routing) << ")";
}

// Pre-activations the way the kernels see them (bf16-rounded), counted against the clamp.
int64_t count_clamped(const HostProblem& problem) {
  const MoeShape& shape = problem.shape;
  const HostRank& rank = problem.ranks[0];
  const int64_t H = shape.hidden;
  const double limit = shape.swiglu_limit;
  int64_t clamped = 0;
  auto count_expert = [&](int64_t token, const bf16* gate, const bf16* up, int64_t inter) {
    for (int64_t i = 0; i < inter; ++i) {
      double g = 0, u = 0;
      for (int64_t h = 0; h < H; ++h) {
        g += test::as_double(rank.x[token * H + h]) * test::as_double(gate[i * H + h]);
        u += test::as_double(rank.x[token * H + h]) * test::as_double(up[i * H + h]);
      }
      g = round_to_bf16(static_cast<float>(g));
      u = round_to_bf16(static_cast<float>(u));
      clamped += (g > limit) + (std::fabs(u) > limit);
    }
  };
  const int64_t I = shape.intermediate;
  for (int64_t t = 0; t < shape.num_tokens; ++t) {
    for (int64_t k = 0; k < shape.top_k; ++k) {
      const int64_t e = rank.top_experts[t * shape.top_k + k];
      if (e >= 0) count_expert(t, rank.w_gate.data() + e * I * H, rank.w_up.data() + e * I * H, I);
    }
    if (shape.has_shared_expert())
      count_expert(t, rank.w_shared_gate.data(), rank.w_shared_up.data(),
                   shape.shared_intermediate);
  }
  return clamped;
}

// Sets every third router weight to 0 and the next one negative.
void make_zero_and_negative_weights(HostProblem& problem) {
  std::vector<float>& weights = problem.ranks[0].router_weights;
  for (size_t slot = 0; slot < weights.size(); ++slot) {
    if (slot % 3 == 0) weights[slot] = 0.0f;
    if (slot % 3 == 1) weights[slot] = -weights[slot] - 0.25f;
  }
}

class ReferenceVsOracle : public ::testing::TestWithParam<OracleCase> {};

TEST_P(ReferenceVsOracle, AllOutputsMatch) {
  const OracleCase& param = GetParam();
  HostProblem problem = HostProblem::make(param.shape, param.routing, 1234);
  if (param.router_weights == RouterWeights::kZeroAndNegative)
    make_zero_and_negative_weights(problem);
  if (param.shape.has_clamp()) {
    ASSERT_GT(count_clamped(problem), 0) << "the clamp limit must actually clamp something";
  }
  if (param.expect_idle_expert) {
    std::vector<int64_t> tokens_per_expert(param.shape.num_experts, 0);
    for (int32_t e : problem.ranks[0].top_experts)
      if (e >= 0) ++tokens_per_expert[e];
    bool idle = false;
    for (int64_t count : tokens_per_expert) idle |= count == 0;
    ASSERT_TRUE(idle) << "the routing was meant to leave an expert without tokens";
  }

  test::run_reference(problem);
  const oracle::Inputs inputs = problem.to_oracle_inputs();
  const oracle::Outputs rounded = oracle::run(problem.shape, inputs, /*round_like_kernel=*/true);
  const oracle::Outputs exact = oracle::run(problem.shape, inputs, /*round_like_kernel=*/false);
  const HostRank& rank = problem.ranks[0];

  // Against the exact math, gradients that pass through the clamp masks are discontinuous:
  // where a pre-activation lies within a bf16 rounding step of the limit, the rounded and the
  // exact computation disagree on whether it is clamped, and that element's gradient flips
  // between its full value and 0. The tight check for them is the rounded oracle; against the
  // exact one they only get a sanity bound when the clamp is on.
  const double exact_tolerance = 1e-2;
  const double masked_exact_tolerance = param.shape.has_clamp() ? 2e-1 : exact_tolerance;
  auto check = [&](const char* name, const auto& actual, const std::vector<double>& want_rounded,
                   const std::vector<double>& want_exact, double exact_bound) {
    EXPECT_FALSE(test::has_nan(actual)) << name << ": unwritten or NaN elements";
    const double error_rounded = relative_error(actual, want_rounded);
    const double error_exact = relative_error(actual, want_exact);
    EXPECT_LE(error_rounded, 5e-3) << name << " vs oracle(round_like_kernel)";
    EXPECT_LE(error_exact, exact_bound) << name << " vs oracle(exact)";
    std::printf("  %-18s rel.err vs rounded oracle %.2e, vs exact oracle %.2e\n", name,
                error_rounded, error_exact);
  };
  check("out", rank.out, rounded.out, exact.out, exact_tolerance);
  check("d_x", rank.d_x, rounded.d_x, exact.d_x, masked_exact_tolerance);
  check("d_router_weights", rank.d_router_weights, rounded.d_router_weights, exact.d_router_weights,
        exact_tolerance);
  check("d_w_gate", rank.d_w_gate, rounded.d_w_gate, exact.d_w_gate, masked_exact_tolerance);
  check("d_w_up", rank.d_w_up, rounded.d_w_up, exact.d_w_up, masked_exact_tolerance);
  check("d_w_down", rank.d_w_down, rounded.d_w_down, exact.d_w_down, exact_tolerance);
  check("d_w_shared_gate", rank.d_w_shared_gate, rounded.d_w_shared_gate, exact.d_w_shared_gate,
        masked_exact_tolerance);
  check("d_w_shared_up", rank.d_w_shared_up, rounded.d_w_shared_up, exact.d_w_shared_up,
        masked_exact_tolerance);
  check("d_w_shared_down", rank.d_w_shared_down, rounded.d_w_shared_down, exact.d_w_shared_down,
        exact_tolerance);

  // Slots without a route get exactly 0; routed slots with weight 0 still get their gradient.
  int64_t zero_weight_slots = 0, zero_weight_nonzero_grads = 0;
  for (size_t slot = 0; slot < rank.top_experts.size(); ++slot) {
    if (rank.top_experts[slot] < 0) {
      EXPECT_EQ(rank.d_router_weights[slot], 0.0f) << "slot " << slot << " has no route";
    } else if (rank.router_weights[slot] == 0.0f) {
      ++zero_weight_slots;
      zero_weight_nonzero_grads += rank.d_router_weights[slot] != 0.0f;
    }
  }
  if (param.router_weights == RouterWeights::kZeroAndNegative) {
    ASSERT_GT(zero_weight_slots, 0);
    EXPECT_EQ(zero_weight_nonzero_grads, zero_weight_slots)
        << "d_router_weights must be computed directly, not divided by the weight";
  }
}

// H, I and Is must be multiples of 64 (can_implement).
std::vector<OracleCase> oracle_cases() {
  std::vector<OracleCase> cases = {
      {"tiny", make_shape(64, 256, 128, 8, 2), RoutingKind::kUniform},
      {"tiny", make_shape(64, 256, 128, 8, 2, 1, 192, 0.4f), RoutingKind::kUniform},
      {"one_token", make_shape(1, 128, 64, 8, 2, 1, 64, 0.3f), RoutingKind::kUniform},
      {"no_tokens", make_shape(0, 128, 64, 8, 2, 1, 64), RoutingKind::kUniform},
      {"tokens_200_skewed", make_shape(200, 128, 64, 8, 3, 1, 128, 0.35f), RoutingKind::kSkewed,
       RouterWeights::kRandom},
      {"shared_smaller_than_routed", make_shape(40, 128, 128, 4, 2, 1, 64, 0.3f),
       RoutingKind::kHoles},
      {"zero_and_negative_weights", make_shape(48, 128, 64, 8, 2, 1, 64, 0.4f),
       RoutingKind::kUniform, RouterWeights::kZeroAndNegative},
      {"idle_experts", make_shape(6, 128, 64, 16, 1, 1, 0, 0.4f), RoutingKind::kSkewed,
       RouterWeights::kRandom, true},
  };
  // Every routing kind, without and with a shared expert and clamp.
  for (RoutingKind kind : all_routing_kinds()) {
    const bool idle = kind == RoutingKind::kOneExpert || kind == RoutingKind::kEmptyRank ||
                      kind == RoutingKind::kNoRoutes;
    cases.push_back({routing_kind_name(kind), make_shape(48, 128, 64, 8, 2), kind,
                     RouterWeights::kRandom, idle});
    cases.push_back({routing_kind_name(kind), make_shape(48, 128, 64, 8, 2, 1, 64, 0.4f), kind,
                     RouterWeights::kRandom, idle});
  }
  return cases;
}

std::string oracle_case_name(const ::testing::TestParamInfo<OracleCase>& info) {
  std::string name = info.param.name;
  if (info.param.shape.has_shared_expert()) name += "_shared";
  if (info.param.shape.has_clamp()) name += "_clamp";
  return name + "_" + std::to_string(info.index);
}

INSTANTIATE_TEST_SUITE_P(Cases, ReferenceVsOracle, ::testing::ValuesIn(oracle_cases()),
                         oracle_case_name);

// ---------------------------------------------------------------------------------------------
// Determinism.

TEST(ReferenceDeterminism, SameBitsForAnyThreadCountAndRun) {
  const MoeShape shape = make_shape(200, 256, 128, 8, 2, 1, 192, 0.4f);
  HostProblem baseline = HostProblem::make(shape, RoutingKind::kSkewed, 99);
  test::run_reference(baseline, 1);
  for (int threads : {2, 3, 2}) {
    HostProblem problem = HostProblem::make(shape, RoutingKind::kSkewed, 99);
    test::run_reference(problem, threads);
    test::for_each_output(problem.ranks[0], baseline.ranks[0],
                          [&](const char* name, const auto& actual, const auto& expected) {
                            EXPECT_TRUE(test::bitwise_equal(actual, expected))
                                << name << " with " << threads << " threads differs at element "
                                << test::first_difference(actual, expected);
                          });
  }
}

TEST(ReferenceDeterminism, Int64ExpertIdsGiveTheSameBits) {
  const MoeShape shape = make_shape(32, 128, 64, 8, 2, 1, 64, 0.4f);
  HostProblem problem32 = HostProblem::make(shape, RoutingKind::kHoles, 5);
  HostProblem problem64 = HostProblem::make(shape, RoutingKind::kHoles, 5);
  test::run_reference(problem32);
  problem64.poison_outputs();
  std::vector<int64_t> ids(problem64.ranks[0].top_experts.begin(),
                           problem64.ranks[0].top_experts.end());
  ForwardArgs forward_args = problem64.forward_args(0);
  BackwardArgs backward_args = problem64.backward_args(0);
  forward_args.top_experts = TensorView::contiguous(ids.data(), DType::kInt64, {32, 2});
  backward_args.forward.top_experts = forward_args.top_experts;
  reference::forward(shape, forward_args);
  reference::backward(shape, backward_args);
  test::for_each_output(problem64.ranks[0], problem32.ranks[0],
                        [&](const char* name, const auto& actual, const auto& expected) {
                          EXPECT_TRUE(test::bitwise_equal(actual, expected)) << name;
                        });
}

// ---------------------------------------------------------------------------------------------
// HostProblem.

TEST(HostProblem, SameSeedSameValuesAndSharedExpertReplicated) {
  const MoeShape shape = make_shape(16, 128, 64, 8, 2, 2, 64, 0.5f);
  const HostProblem a = HostProblem::make(shape, RoutingKind::kUniform, 42);
  const HostProblem b = HostProblem::make(shape, RoutingKind::kUniform, 42);
  const HostProblem c = HostProblem::make(shape, RoutingKind::kUniform, 43);
  for (int32_t rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(test::bitwise_equal(a.ranks[rank].x, b.ranks[rank].x));
    EXPECT_TRUE(test::bitwise_equal(a.ranks[rank].w_down, b.ranks[rank].w_down));
    EXPECT_TRUE(test::bitwise_equal(a.ranks[rank].router_weights, b.ranks[rank].router_weights));
    EXPECT_FALSE(test::bitwise_equal(a.ranks[rank].x, c.ranks[rank].x));
    EXPECT_TRUE(test::bitwise_equal(a.ranks[rank].w_shared_gate, a.ranks[0].w_shared_gate));
  }
  EXPECT_FALSE(test::bitwise_equal(a.ranks[0].x, a.ranks[1].x));
  EXPECT_FALSE(test::bitwise_equal(a.ranks[0].w_gate, a.ranks[1].w_gate));
}

TEST(HostProblem, BytesNeededCoversTheBuffers) {
  const MoeShape shape = make_shape(24, 128, 64, 8, 3, 4, 128);
  const HostProblem problem = HostProblem::make(shape, RoutingKind::kHoles, 1);
  int64_t bytes = 0;
  auto add = [&](const auto& values) { bytes += values.size() * sizeof(values[0]); };
  for (const HostRank& rank : problem.ranks) {
    for (const auto* v : {&rank.x, &rank.d_out, &rank.w_gate, &rank.w_up, &rank.w_down,
                          &rank.w_shared_gate, &rank.w_shared_up, &rank.w_shared_down, &rank.out,
                          &rank.d_x, &rank.d_w_gate, &rank.d_w_up, &rank.d_w_down,
                          &rank.d_w_shared_gate, &rank.d_w_shared_up, &rank.d_w_shared_down})
      add(*v);
    add(rank.top_experts);
    add(rank.router_weights);
    add(rank.d_router_weights);
  }
  EXPECT_GE(HostProblem::bytes_needed(shape), bytes);
  EXPECT_LE(HostProblem::bytes_needed(shape), bytes * 11 / 10);
}

TEST(HostProblem, SingleRankEquivalentConcatenatesTokensAndExperts) {
  const MoeShape shape = make_shape(8, 128, 64, 8, 2, 4, 64);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 3);
  const HostProblem single = problem.single_rank_equivalent();
  EXPECT_EQ(single.shape.num_ranks, 1);
  EXPECT_EQ(single.shape.num_tokens, 32);
  const HostRank& all = single.ranks[0];
  const int64_t expert_weights = 2 * 64 * 128;  // E_loc = 2
  for (int32_t rank = 0; rank < 4; ++rank) {
    EXPECT_TRUE(
        test::bitwise_equal(test::slice(all.x, rank * 8 * 128, 8 * 128), problem.ranks[rank].x));
    EXPECT_TRUE(test::bitwise_equal(test::slice(all.w_up, rank * expert_weights, expert_weights),
                                    problem.ranks[rank].w_up));
  }
  const HostProblem alone = problem.rank_alone(2);
  EXPECT_EQ(alone.shape.num_tokens, 8);
  EXPECT_TRUE(test::bitwise_equal(alone.ranks[0].top_experts, problem.ranks[2].top_experts));
  EXPECT_THROW(problem.to_oracle_inputs(), Error);
  EXPECT_THROW(problem.rank_alone(4), Error);
  problem.poison_outputs();
  EXPECT_TRUE(test::has_nan(problem.ranks[3].d_w_down));
  EXPECT_TRUE(test::has_nan(problem.ranks[3].d_router_weights));
}

// ---------------------------------------------------------------------------------------------
// Validation: errors before anything is written.

bool still_poisoned(const std::vector<bf16>& values) {
  for (bf16 value : values)
    if (value.bits != kPoisonBf16Bits) return false;
  return true;
}

// Frozen weights (every weight gradient absent): the same d_x and d_router_weights, bit for
// bit, as the full backward, on one rank and in a 2-rank group, with a shared expert; the
// weight-gradient buffers are not written. A partial set is refused, naming the argument.
TEST(ReferenceFrozenWeights, SameInputGradientsAndNoWeightGradients) {
  for (int32_t ranks : {1, 2}) {
    SCOPED_TRACE(testing::Message() << ranks << " ranks");
    const MoeShape shape = make_shape(48, 128, 64, 8, 2, ranks, 64, 0.5f);
    HostProblem full = HostProblem::make(shape, RoutingKind::kSkewed, 21);
    test::run_reference(full);
    HostProblem frozen = HostProblem::make(shape, RoutingKind::kSkewed, 21);
    frozen.poison_outputs();
    std::vector<ForwardArgs> forward_args = frozen.all_forward_args();
    std::vector<BackwardArgs> backward_args = frozen.all_backward_args();
    for (BackwardArgs& args : backward_args) {
      args = without_weight_gradients(args);
      EXPECT_FALSE(wants_weight_gradients(args));
    }
    reference::forward_ep(shape, forward_args);
    reference::backward_ep(shape, backward_args);
    for (int32_t r = 0; r < ranks; ++r) {
      EXPECT_TRUE(test::bitwise_equal(frozen.ranks[r].d_x, full.ranks[r].d_x)) << "rank " << r;
      EXPECT_TRUE(
          test::bitwise_equal(frozen.ranks[r].d_router_weights, full.ranks[r].d_router_weights))
          << "rank " << r;
      EXPECT_TRUE(still_poisoned(frozen.ranks[r].d_w_gate)) << "rank " << r;
      EXPECT_TRUE(still_poisoned(frozen.ranks[r].d_w_shared_down)) << "rank " << r;
    }
  }
  const MoeShape shape = make_shape(16, 128, 64, 4, 2, 1);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kUniform, 3);
  reference::forward(shape, problem.forward_args(0));
  BackwardArgs partial = problem.backward_args(0);
  partial.d_w_gate = TensorView{};
  test::expect_invalid_argument([&] { reference::backward(shape, partial); },
                                "`d_w_up` was given without d_w_gate");
}

TEST(ReferenceValidation, WrongRankCountIsRejected) {
  HostProblem problem =
      HostProblem::make(make_shape(8, 128, 64, 4, 2, 2), RoutingKind::kUniform, 1);
  problem.poison_outputs();
  std::vector<ForwardArgs> args = problem.all_forward_args();
  args.pop_back();
  test::expect_invalid_argument([&] { reference::forward_ep(problem.shape, args); },
                                "num_ranks = 2");
  EXPECT_TRUE(still_poisoned(problem.ranks[0].out));
  EXPECT_THROW(reference::forward(problem.shape, problem.forward_args(0)), Error);
}

TEST(ReferenceValidation, BadExpertIdOnAnyRankWritesNothing) {
  HostProblem problem =
      HostProblem::make(make_shape(8, 128, 64, 4, 2, 2), RoutingKind::kUniform, 1);
  problem.ranks[1].top_experts[5] = 4;  // E = 4: out of range
  problem.poison_outputs();
  try {
    reference::forward_ep(problem.shape, problem.all_forward_args());
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("rank 1, token 2, k 1"), std::string::npos)
        << error.what();
  }
  EXPECT_THROW(reference::backward_ep(problem.shape, problem.all_backward_args()), Error);
  for (const HostRank& rank : problem.ranks) {
    EXPECT_TRUE(still_poisoned(rank.out));
    EXPECT_TRUE(still_poisoned(rank.d_x));
    EXPECT_TRUE(still_poisoned(rank.d_w_gate));
  }
}

TEST(ReferenceValidation, OutputsSharedBetweenRanksAreRejected) {
  HostProblem problem =
      HostProblem::make(make_shape(8, 128, 64, 4, 2, 2), RoutingKind::kUniform, 1);
  std::vector<ForwardArgs> args = problem.all_forward_args();
  args[1].out = args[0].out;
  try {
    reference::forward_ep(problem.shape, args);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("overlaps"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace mok
