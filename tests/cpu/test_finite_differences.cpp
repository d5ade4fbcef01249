// The oracle's exact backward (round_like_kernel = false) against central finite differences of
// its own forward loss L = <d_out, out>, for every input and weight, with the clamp on; and the
// reference's router-weight gradients for zero and negative weights against the same
// differences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "mok/reference.h"
#include "mok/testing/host_problem.h"
#include "mok/testing/routing.h"
#include "test_util.h"

namespace mok {
namespace {

double loss(const MoeShape& shape, oracle::Inputs inputs) {
  const std::vector<double> d_out = std::move(inputs.d_out);
  inputs.d_out.clear();  // forward only
  const oracle::Outputs outputs = oracle::run(shape, inputs, /*round_like_kernel=*/false);
  double sum = 0;
  for (size_t i = 0; i < d_out.size(); ++i) sum += d_out[i] * outputs.out[i];
  return sum;
}

// Every pre-activation the clamp looks at: g (clamped above) and |u| (clamped both sides).
std::vector<double> clamp_sensitive_values(const MoeShape& shape, const oracle::Inputs& in) {
  const int64_t H = shape.hidden;
  std::vector<double> values;
  auto add_expert = [&](const double* x, const double* gate, const double* up, int64_t inter) {
    for (int64_t i = 0; i < inter; ++i) {
      double g = 0, u = 0;
      for (int64_t h = 0; h < H; ++h) {
        g += x[h] * gate[i * H + h];
        u += x[h] * up[i * H + h];
      }
      values.push_back(g);
      values.push_back(std::fabs(u));
    }
  };
  const int64_t I = shape.intermediate;
  for (int64_t t = 0; t < shape.num_tokens; ++t) {
    const double* x = in.x.data() + t * H;
    for (int64_t k = 0; k < shape.top_k; ++k) {
      const int64_t e = in.top_experts[t * shape.top_k + k];
      if (e >= 0) add_expert(x, in.w_gate.data() + e * I * H, in.w_up.data() + e * I * H, I);
    }
    add_expert(x, in.w_shared_gate.data(), in.w_shared_up.data(), shape.shared_intermediate);
  }
  std::sort(values.begin(), values.end());
  return values;
}

struct FdProblem {
  MoeShape shape;
  oracle::Inputs inputs;
  double clamp_margin = 0;  // distance of the nearest pre-activation to the clamp limit
};

// A small problem in plain doubles (the oracle needs no 64-multiples), with router weights
// that are positive, exactly zero and negative, one unrouted slot, and a clamp limit placed in
// the widest gap of the upper pre-activations so that some values are clamped and none sits
// near the kink.
FdProblem make_fd_problem() {
  FdProblem problem;
  MoeShape& shape = problem.shape;
  shape.num_tokens = 5;
  shape.hidden = 16;
  shape.intermediate = 8;
  shape.num_experts = 4;
  shape.top_k = 2;
  shape.shared_intermediate = 12;
  const int64_t T = 5, H = 16, I = 8, E = 4, K = 2, Is = 12;
  SplitMix64 rng(2024);
  auto uniform = [&](int64_t count, double scale) {
    std::vector<double> values(count);
    for (double& value : values) value = (2 * rng.uniform() - 1) * scale;
    return values;
  };
  oracle::Inputs& in = problem.inputs;
  in.x = uniform(T * H, 1.0);
  in.d_out = uniform(T * H, 1.0);
  in.w_gate = uniform(E * I * H, 0.5);
  in.w_up = uniform(E * I * H, 0.5);
  in.w_down = uniform(E * H * I, 0.4);
  in.w_shared_gate = uniform(Is * H, 0.5);
  in.w_shared_up = uniform(Is * H, 0.5);
  in.w_shared_down = uniform(H * Is, 0.4);
  const std::vector<int32_t> routing = generate_routing(RoutingKind::kUniform, 1, T, K, E, 9);
  in.top_experts.assign(routing.begin(), routing.end());
  in.top_experts[3] = -1;
  in.router_weights = uniform(T * K, 1.0);
  in.router_weights[0] = 0.0;
  in.router_weights[4] = 0.0;
  in.router_weights[5] = -0.7;

  const std::vector<double> values = clamp_sensitive_values(shape, in);
  const size_t lo = values.size() * 6 / 10, hi = values.size() * 95 / 100;
  size_t widest = lo;
  for (size_t i = lo; i < hi; ++i)
    if (values[i + 1] - values[i] > values[widest + 1] - values[widest]) widest = i;
  shape.swiglu_limit = static_cast<float>((values[widest] + values[widest + 1]) / 2);
  problem.clamp_margin = 1e300;
  for (double value : values)
    problem.clamp_margin = std::min(problem.clamp_margin, std::fabs(value - shape.swiglu_limit));
  return problem;
}

// Central differences of `loss` with respect to every element of `parameter`.
std::vector<double> finite_differences(const MoeShape& shape, oracle::Inputs& inputs,
                                       std::vector<double>& parameter, double eps) {
  std::vector<double> grads(parameter.size());
  for (size_t i = 0; i < parameter.size(); ++i) {
    const double saved = parameter[i];
    parameter[i] = saved + eps;
    const double plus = loss(shape, inputs);
    parameter[i] = saved - eps;
    const double minus = loss(shape, inputs);
    parameter[i] = saved;
    grads[i] = (plus - minus) / (2 * eps);
  }
  return grads;
}

TEST(FiniteDifferences, OracleBackwardIsTheGradientOfItsForward) {
  FdProblem problem = make_fd_problem();
  const MoeShape& shape = problem.shape;
  constexpr double kEps = 1e-6;
  // Perturbing one parameter by eps moves a pre-activation by at most eps times one input or
  // weight (all below 1): far less than the margin, so no clamp decision changes between the
  // +eps and -eps evaluations.
  ASSERT_GT(problem.clamp_margin, 1e3 * kEps);
  const std::vector<double> values = clamp_sensitive_values(shape, problem.inputs);
  ASSERT_GT(
      std::count_if(values.begin(), values.end(), [&](double v) { return v > shape.swiglu_limit; }),
      0)
      << "the clamp limit must clamp something";

  const oracle::Outputs analytic = oracle::run(shape, problem.inputs, false);
  oracle::Inputs& in = problem.inputs;
  struct Parameter {
    const char* name;
    std::vector<double>* values;
    const std::vector<double>* gradient;
  };
  const Parameter parameters[] = {
      {"x", &in.x, &analytic.d_x},
      {"router_weights", &in.router_weights, &analytic.d_router_weights},
      {"w_gate", &in.w_gate, &analytic.d_w_gate},
      {"w_up", &in.w_up, &analytic.d_w_up},
      {"w_down", &in.w_down, &analytic.d_w_down},
      {"w_shared_gate", &in.w_shared_gate, &analytic.d_w_shared_gate},
      {"w_shared_up", &in.w_shared_up, &analytic.d_w_shared_up},
      {"w_shared_down", &in.w_shared_down, &analytic.d_w_shared_down},
  };
  for (const Parameter& parameter : parameters) {
    const std::vector<double> numeric = finite_differences(shape, in, *parameter.values, kEps);
    ASSERT_EQ(numeric.size(), parameter.gradient->size()) << parameter.name;
    double worst = 0;
    for (size_t i = 0; i < numeric.size(); ++i) {
      const double error = std::fabs(numeric[i] - (*parameter.gradient)[i]);
      worst = std::max(worst, error / (1e-6 + std::fabs(numeric[i])));
      EXPECT_NEAR((*parameter.gradient)[i], numeric[i], 1e-6 + 1e-6 * std::fabs(numeric[i]))
          << parameter.name << "[" << i << "]";
    }
    EXPECT_GT(test::norm2(numeric), 0.0) << parameter.name << ": a zero gradient tests nothing";
    std::printf("  %-15s worst relative error vs finite differences %.1e\n", parameter.name, worst);
  }
  // The router-weight gradient is exact for zero and negative weights, and 0 without a route.
  EXPECT_NE(analytic.d_router_weights[0], 0.0);
  EXPECT_NE(analytic.d_router_weights[4], 0.0);
  EXPECT_EQ(analytic.d_router_weights[3], 0.0);
}

// The reference's d_router_weights (bf16 operands, fp32 sums) against finite differences of the
// exact forward at the same bf16 inputs: out is linear in each weight, so the differences are
// exact up to round-off, for zero and negative weights alike.
TEST(FiniteDifferences, ReferenceRouterWeightGradientsForZeroAndNegativeWeights) {
  const MoeShape shape = test::make_shape(12, 128, 64, 4, 2, 1, 64, 0.5f);
  HostProblem problem = HostProblem::make(shape, RoutingKind::kHoles, 31);
  std::vector<float>& weights = problem.ranks[0].router_weights;
  for (size_t slot = 0; slot < weights.size(); ++slot) {
    if (slot % 3 == 0) weights[slot] = 0.0f;
    if (slot % 3 == 1) weights[slot] = -1.5f * weights[slot] - 0.1f;
  }
  test::run_reference(problem);
  const HostRank& rank = problem.ranks[0];

  oracle::Inputs inputs = problem.to_oracle_inputs();
  const std::vector<double> numeric =
      finite_differences(shape, inputs, inputs.router_weights, 1e-3);
  const oracle::Outputs exact = oracle::run(shape, inputs, false);
  EXPECT_LE(test::relative_error(exact.d_router_weights, numeric), 1e-8);
  EXPECT_LE(test::relative_error(rank.d_router_weights, numeric), 1e-2);

  int64_t zero_weight_slots = 0, negative_weight_slots = 0;
  for (size_t slot = 0; slot < weights.size(); ++slot) {
    if (rank.top_experts[slot] < 0) {
      EXPECT_EQ(rank.d_router_weights[slot], 0.0f);
      continue;
    }
    zero_weight_slots += weights[slot] == 0.0f;
    negative_weight_slots += weights[slot] < 0.0f;
    // Per slot, within bf16 accuracy of the slot's own scale.
    EXPECT_NEAR(rank.d_router_weights[slot], numeric[slot], 2e-2 * std::fabs(numeric[slot]) + 1e-3)
        << "slot " << slot << ", router weight " << weights[slot];
    if (weights[slot] == 0.0f) {
      EXPECT_NE(rank.d_router_weights[slot], 0.0f) << "slot " << slot;
    }
  }
  EXPECT_GT(zero_weight_slots, 0);
  EXPECT_GT(negative_weight_slots, 0);
}

}  // namespace
}  // namespace mok
