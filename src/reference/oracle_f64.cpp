// The double-precision oracle of the MoE layer (mok::oracle::run). Written apart from the
// reference on purpose: plain loops per token and slot, double sums, no schedule, no blocking,
// no shared code except the bf16 rounding of dtype.h. It checks the reference's math, and
// (without rounding) is the exact function the finite-difference test differentiates.
#include <cmath>
#include <string>
#include <vector>

#include "mok/dtype.h"
#include "mok/error.h"
#include "mok/reference.h"

namespace mok::oracle {

namespace {

// The rounding points of docs/design.md, applied only when imitating the kernels.
struct Rounder {
  bool enabled;
  double operator()(double value) const {
    return enabled ? static_cast<double>(round_to_bf16(static_cast<float>(value))) : value;
  }
};

void require_size(const char* name, size_t actual, int64_t expected) {
  if (static_cast<int64_t>(actual) != expected)
    throw Error(ErrorCode::kInvalidArgument, std::string("oracle::run: inputs.") + name + " has " +
                                                 std::to_string(actual) + " values; expected " +
                                                 std::to_string(expected));
}

// One expert's weights inside the flat input arrays.
struct ExpertMatrices {
  const double* gate;  // [inter, hidden]
  const double* up;    // [inter, hidden]
  const double* down;  // [hidden, inter]
  int64_t inter;
};

// The forward intermediates of one expert applied to one token.
struct TokenExpert {
  std::vector<double> gate, up;  // after clamping
  std::vector<bool> gate_passes, up_passes;
  std::vector<double> hidden;
  std::vector<double> y;
};

double silu(double g) { return g / (1.0 + std::exp(-g)); }
double sigmoid(double g) { return 1.0 / (1.0 + std::exp(-g)); }

TokenExpert expert_forward(const double* x, const ExpertMatrices& expert, int64_t hidden,
                           double limit, const Rounder& round) {
  TokenExpert result;
  const int64_t inter = expert.inter;
  result.gate.resize(inter);
  result.up.resize(inter);
  result.gate_passes.resize(inter);
  result.up_passes.resize(inter);
  result.hidden.resize(inter);
  for (int64_t i = 0; i < inter; ++i) {
    double g = 0, u = 0;
    for (int64_t h = 0; h < hidden; ++h) {
      g += x[h] * expert.gate[i * hidden + h];
      u += x[h] * expert.up[i * hidden + h];
    }
    g = round(g);
    u = round(u);
    result.gate_passes[i] = !(g > limit);
    result.up_passes[i] = !(u > limit) && !(u < -limit);
    if (g > limit) g = limit;
    if (u > limit) u = limit;
    if (u < -limit) u = -limit;
    result.gate[i] = g;
    result.up[i] = u;
    result.hidden[i] = round(silu(g) * u);
  }
  result.y.resize(hidden);
  for (int64_t n = 0; n < hidden; ++n) {
    double sum = 0;
    for (int64_t i = 0; i < inter; ++i) sum += result.hidden[i] * expert.down[n * inter + i];
    result.y[n] = round(sum);
  }
  return result;
}

// Where one expert's backward accumulates.
struct ExpertGradSums {
  double* d_gate;  // [inter, hidden]
  double* d_up;    // [inter, hidden]
  double* d_down;  // [hidden, inter]
};

// Backward of one expert on one token with router weight `weight`: adds the weight gradients,
// writes the token's dx row (length hidden) and returns d(loss)/d(weight).
double expert_backward(const double* x, const double* d_out, double weight,
                       const ExpertMatrices& expert, const TokenExpert& fwd, int64_t hidden,
                       const Rounder& round, const ExpertGradSums& sums, double* dx) {
  const int64_t inter = expert.inter;
  std::vector<double> dh_raw(inter), d_gate(inter), d_up(inter), weighted_hidden(inter);
  double d_weight = 0;
  for (int64_t i = 0; i < inter; ++i) {
    double sum = 0;
    for (int64_t n = 0; n < hidden; ++n) sum += d_out[n] * expert.down[n * inter + i];
    dh_raw[i] = round(sum);
    d_weight += dh_raw[i] * fwd.hidden[i];
  }
  for (int64_t i = 0; i < inter; ++i) {
    const double dh = weight * dh_raw[i];
    const double g = fwd.gate[i], u = fwd.up[i];
    const double s = sigmoid(g);
    d_up[i] = fwd.up_passes[i] ? round(dh * silu(g)) : 0.0;
    d_gate[i] = fwd.gate_passes[i] ? round(dh * u * s * (1.0 + g * (1.0 - s))) : 0.0;
    weighted_hidden[i] = round(weight * fwd.hidden[i]);
  }
  for (int64_t h = 0; h < hidden; ++h) {
    double sum = 0;
    for (int64_t i = 0; i < inter; ++i)
      sum += d_gate[i] * expert.gate[i * hidden + h] + d_up[i] * expert.up[i * hidden + h];
    dx[h] = round(sum);
  }
  for (int64_t n = 0; n < hidden; ++n)
    for (int64_t i = 0; i < inter; ++i) sums.d_down[n * inter + i] += d_out[n] * weighted_hidden[i];
  for (int64_t i = 0; i < inter; ++i)
    for (int64_t h = 0; h < hidden; ++h) {
      sums.d_gate[i * hidden + h] += d_gate[i] * x[h];
      sums.d_up[i * hidden + h] += d_up[i] * x[h];
    }
  return d_weight;
}

void round_all(std::vector<double>& values, const Rounder& round) {
  for (double& value : values) value = round(value);
}

}  // namespace

Outputs run(const MoeShape& shape, const Inputs& inputs, bool round_like_kernel) {
  if (shape.num_ranks != 1)
    throw Error(ErrorCode::kInvalidArgument,
                "oracle::run: shape.num_ranks = " + std::to_string(shape.num_ranks) +
                    "; the oracle is single-rank, valid: 1");
  const int64_t tokens = shape.num_tokens, hidden = shape.hidden, inter = shape.intermediate;
  const int64_t experts = shape.num_experts, top_k = shape.top_k;
  const int64_t shared_inter = shape.shared_intermediate;
  require_size("x", inputs.x.size(), tokens * hidden);
  require_size("top_experts", inputs.top_experts.size(), tokens * top_k);
  require_size("router_weights", inputs.router_weights.size(), tokens * top_k);
  require_size("w_gate", inputs.w_gate.size(), experts * inter * hidden);
  require_size("w_up", inputs.w_up.size(), experts * inter * hidden);
  require_size("w_down", inputs.w_down.size(), experts * hidden * inter);
  require_size("w_shared_gate", inputs.w_shared_gate.size(), shared_inter * hidden);
  require_size("w_shared_up", inputs.w_shared_up.size(), shared_inter * hidden);
  require_size("w_shared_down", inputs.w_shared_down.size(), hidden * shared_inter);
  // With no tokens d_out is empty too, and the backward (all zeros) is returned as well.
  const bool with_backward = !inputs.d_out.empty() || tokens == 0;
  if (with_backward) require_size("d_out", inputs.d_out.size(), tokens * hidden);
  for (size_t slot = 0; slot < inputs.top_experts.size(); ++slot) {
    const int64_t expert = inputs.top_experts[slot];
    if (expert < -1 || expert >= experts)
      throw Error(ErrorCode::kInvalidArgument,
                  "oracle::run: inputs.top_experts[" + std::to_string(slot) +
                      "] = " + std::to_string(expert) + "; valid: -1 or [0, " +
                      std::to_string(experts) + ")");
  }

  const Rounder round{round_like_kernel};
  const double limit = shape.swiglu_limit;  // +inf: no clamp
  auto routed_expert = [&](int64_t expert) {
    return ExpertMatrices{inputs.w_gate.data() + expert * inter * hidden,
                          inputs.w_up.data() + expert * inter * hidden,
                          inputs.w_down.data() + expert * hidden * inter, inter};
  };
  const ExpertMatrices shared{inputs.w_shared_gate.data(), inputs.w_shared_up.data(),
                              inputs.w_shared_down.data(), shared_inter};

  Outputs result;
  result.out.assign(tokens * hidden, 0.0);
  if (with_backward) {
    result.d_x.assign(tokens * hidden, 0.0);
    result.d_router_weights.assign(tokens * top_k, 0.0);
    result.d_w_gate.assign(experts * inter * hidden, 0.0);
    result.d_w_up.assign(experts * inter * hidden, 0.0);
    result.d_w_down.assign(experts * hidden * inter, 0.0);
    result.d_w_shared_gate.assign(shared_inter * hidden, 0.0);
    result.d_w_shared_up.assign(shared_inter * hidden, 0.0);
    result.d_w_shared_down.assign(hidden * shared_inter, 0.0);
  }

  std::vector<double> dx_row(hidden);
  for (int64_t t = 0; t < tokens; ++t) {
    const double* x = inputs.x.data() + t * hidden;
    const double* d_out = with_backward ? inputs.d_out.data() + t * hidden : nullptr;
    std::vector<double> out_sum(hidden, 0.0), dx_sum(hidden, 0.0);

    if (shared_inter > 0) {
      const TokenExpert fwd = expert_forward(x, shared, hidden, limit, round);
      for (int64_t n = 0; n < hidden; ++n) out_sum[n] += fwd.y[n];
      if (with_backward) {
        const ExpertGradSums sums{result.d_w_shared_gate.data(), result.d_w_shared_up.data(),
                                  result.d_w_shared_down.data()};
        expert_backward(x, d_out, 1.0, shared, fwd, hidden, round, sums, dx_row.data());
        for (int64_t h = 0; h < hidden; ++h) dx_sum[h] += dx_row[h];
      }
    }
    for (int64_t k = 0; k < top_k; ++k) {
      const int64_t expert = inputs.top_experts[t * top_k + k];
      if (expert < 0) continue;
      const double weight = inputs.router_weights[t * top_k + k];
      const ExpertMatrices matrices = routed_expert(expert);
      const TokenExpert fwd = expert_forward(x, matrices, hidden, limit, round);
      for (int64_t n = 0; n < hidden; ++n) out_sum[n] += weight * fwd.y[n];
      if (with_backward) {
        const ExpertGradSums sums{result.d_w_gate.data() + expert * inter * hidden,
                                  result.d_w_up.data() + expert * inter * hidden,
                                  result.d_w_down.data() + expert * hidden * inter};
        result.d_router_weights[t * top_k + k] =
            expert_backward(x, d_out, weight, matrices, fwd, hidden, round, sums, dx_row.data());
        for (int64_t h = 0; h < hidden; ++h) dx_sum[h] += dx_row[h];
      }
    }
    for (int64_t n = 0; n < hidden; ++n) {
      result.out[t * hidden + n] = round(out_sum[n]);
      if (with_backward) result.d_x[t * hidden + n] = round(dx_sum[n]);
    }
  }

  if (with_backward)
    for (auto* grad : {&result.d_w_gate, &result.d_w_up, &result.d_w_down, &result.d_w_shared_gate,
                       &result.d_w_shared_up, &result.d_w_shared_down})
      round_all(*grad, round);
  return result;
}

}  // namespace mok::oracle
