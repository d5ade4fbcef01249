// Helpers shared by the CPU and GPU tests: norms and relative errors over arrays of bf16 / fp32 /
// fp64, finiteness, bitwise comparison, slicing, shapes, and running the reference.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "mok/dtype.h"
#include "mok/error.h"
#include "mok/reference.h"
#include "mok/shape.h"
#include "mok/testing/host_problem.h"

namespace mok::test {

inline double as_double(bf16 value) { return bf16_to_float(value); }
inline double as_double(float value) { return value; }
inline double as_double(double value) { return value; }

// ||actual - expected|| / ||expected|| (2-norms). When expected is all zero, returns
// ||actual||, so an exact zero matches and anything else does not. NaN anywhere gives NaN,
// which fails every `<=` check.
template <typename A, typename B>
double relative_error(const std::vector<A>& actual, const std::vector<B>& expected) {
  if (actual.size() != expected.size()) return std::numeric_limits<double>::infinity();
  double diff = 0, norm = 0;
  for (size_t i = 0; i < actual.size(); ++i) {
    const double a = as_double(actual[i]), b = as_double(expected[i]);
    diff += (a - b) * (a - b);
    norm += b * b;
  }
  return norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

template <typename T>
bool has_nan(const std::vector<T>& values) {
  for (const T& value : values)
    if (std::isnan(as_double(value))) return true;
  return false;
}

// No NaN and no infinity: poisoned (unwritten) elements are NaN.
template <typename T>
bool all_finite(const std::vector<T>& values) {
  for (const T& value : values)
    if (!std::isfinite(as_double(value))) return false;
  return true;
}

template <typename T>
double norm2(const std::vector<T>& values) {
  double sum = 0;
  for (const T& value : values) sum += as_double(value) * as_double(value);
  return std::sqrt(sum);
}

// Same bits, element for element (so NaN == NaN with the same payload, and +0 != -0).
template <typename T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// Index of the first differing element, or -1.
template <typename T>
int64_t first_difference(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return static_cast<int64_t>(i);
  return -1;
}

template <typename T>
std::vector<T> slice(const std::vector<T>& values, int64_t begin, int64_t count) {
  return std::vector<T>(values.begin() + begin, values.begin() + begin + count);
}

inline MoeShape make_shape(int64_t tokens, int64_t hidden, int64_t inter, int64_t experts,
                           int32_t top_k, int32_t ranks = 1, int64_t shared_inter = 0,
                           float swiglu_limit = std::numeric_limits<float>::infinity()) {
  MoeShape shape;
  shape.num_tokens = tokens;
  shape.hidden = hidden;
  shape.intermediate = inter;
  shape.num_experts = experts;
  shape.top_k = top_k;
  shape.num_ranks = ranks;
  shape.shared_intermediate = shared_inter;
  shape.swiglu_limit = swiglu_limit;
  return shape;
}

// Poisons the outputs, then runs the reference forward and backward on every rank.
inline void run_reference(HostProblem& problem, int num_threads = 0) {
  reference::Options options;
  options.num_threads = num_threads;
  problem.poison_outputs();
  reference::forward_ep(problem.shape, problem.all_forward_args(), options);
  reference::backward_ep(problem.shape, problem.all_backward_args(), options);
}

// Calls fn(name, a, b) for every output tensor of two ranks; the pairs have the same type.
template <typename Fn>
void for_each_output(const HostRank& a, const HostRank& b, Fn&& fn) {
  for_each_output_field([&](const char* name, auto member) { fn(name, a.*member, b.*member); });
}

// `call()` throws a mok::Error of kInvalidArgument whose message contains `fragment` (a refusal
// that names the argument).
template <typename Call>
void expect_invalid_argument(Call call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error containing: " << fragment;
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument) << error.what();
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

}  // namespace mok::test
