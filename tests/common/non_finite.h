// Non-finite inputs for the tests of docs/design.md's contract "NaN and infinities land exactly
// where the reference's IEEE math puts them": the places one such value goes, and the element by
// element comparison of an output's non-finite pattern with the reference's.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "mok/dtype.h"
#include "mok/testing/host_problem.h"
#include "test_util.h"

namespace mok::test {

// Where one non-finite value goes (rank 0 of a problem prepared by add_duplicate_route_and_hole).
enum class NonFiniteSite {
  kX,           // x of the token routed twice to one expert
  kRoutedGate,  // w_gate, w_up, w_down of the expert that token is routed to twice
  kRoutedUp,
  kRoutedDown,
  kSharedGate,  // the shared expert's weights
  kSharedUp,
  kSharedDown,
  kDOut,                  // d_out of the token with a -1 slot
  kRouterWeight,          // the router weight of the token's second route to that expert
  kUnroutedRouterWeight,  // the router weight of the -1 slot: the layer reads it nowhere
};

inline const char* non_finite_site_name(NonFiniteSite site) {
  switch (site) {
    case NonFiniteSite::kX:
      return "x";
    case NonFiniteSite::kRoutedGate:
      return "w_gate";
    case NonFiniteSite::kRoutedUp:
      return "w_up";
    case NonFiniteSite::kRoutedDown:
      return "w_down";
    case NonFiniteSite::kSharedGate:
      return "w_shared_gate";
    case NonFiniteSite::kSharedUp:
      return "w_shared_up";
    case NonFiniteSite::kSharedDown:
      return "w_shared_down";
    case NonFiniteSite::kDOut:
      return "d_out";
    case NonFiniteSite::kRouterWeight:
      return "router_weights";
    case NonFiniteSite::kUnroutedRouterWeight:
      return "router_weights (-1 slot)";
  }
  return "?";
}

// Every site, the shared expert's only when the shape has one.
inline std::vector<NonFiniteSite> non_finite_sites(const MoeShape& shape) {
  std::vector<NonFiniteSite> sites = {NonFiniteSite::kX,
                                      NonFiniteSite::kRoutedGate,
                                      NonFiniteSite::kRoutedUp,
                                      NonFiniteSite::kRoutedDown,
                                      NonFiniteSite::kDOut,
                                      NonFiniteSite::kRouterWeight,
                                      NonFiniteSite::kUnroutedRouterWeight};
  if (shape.has_shared_expert())
    for (NonFiniteSite site :
         {NonFiniteSite::kSharedGate, NonFiniteSite::kSharedUp, NonFiniteSite::kSharedDown})
      sites.push_back(site);
  return sites;
}

inline std::vector<float> non_finite_values() {
  return {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
          -std::numeric_limits<float>::infinity()};
}

// The tokens of rank 0 that add_duplicate_route_and_hole changes.
inline int64_t twice_routed_token(const MoeShape& shape) { return shape.num_tokens > 1 ? 1 : 0; }
inline int64_t token_with_hole(const MoeShape& shape) { return shape.num_tokens > 2 ? 2 : 0; }

// On rank 0: the twice-routed token sends its slots 0 and 1 to one expert of rank 0 (its slot
// 0's expert with one rank), and the token with a hole gets -1 in its last slot. Needs K >= 2.
inline void add_duplicate_route_and_hole(HostProblem& problem) {
  const MoeShape& shape = problem.shape;
  std::vector<int32_t>& routes = problem.ranks[0].top_experts;
  const int64_t K = shape.top_k;
  const int64_t twice = twice_routed_token(shape) * K;
  routes[twice] =
      routes[twice] < 0 ? 0 : routes[twice] % static_cast<int32_t>(shape.num_local_experts());
  routes[twice + 1] = routes[twice];
  routes[token_with_hole(shape) * K + K - 1] = -1;
}

// Puts `value` at `site` of rank 0 (which add_duplicate_route_and_hole prepared); returns where,
// in words. The expert sites pick the expert the twice-routed token goes to (one of rank 0's).
inline std::string place_non_finite(HostProblem& problem, NonFiniteSite site, float value) {
  const MoeShape& shape = problem.shape;
  HostRank& rank = problem.ranks[0];
  const int64_t H = shape.hidden, I = shape.intermediate, Is = shape.shared_intermediate;
  const int64_t K = shape.top_k;
  const int64_t twice = twice_routed_token(shape), hole = token_with_hole(shape);
  const int64_t expert = rank.top_experts[twice * K];
  const bf16 bits = float_to_bf16(value);
  auto put = [&](std::vector<bf16>& tensor, int64_t index) {
    tensor[static_cast<size_t>(index)] = bits;
    return std::string(" at element ") + std::to_string(index);
  };
  std::string where = non_finite_site_name(site);
  switch (site) {
    case NonFiniteSite::kX:
      return where + put(rank.x, twice * H + H / 3);
    case NonFiniteSite::kRoutedGate:
      return where + put(rank.w_gate, (expert * I + I / 2) * H + 7);
    case NonFiniteSite::kRoutedUp:
      return where + put(rank.w_up, (expert * I + 3) * H + H - 1);
    case NonFiniteSite::kRoutedDown:
      return where + put(rank.w_down, (expert * H + 5) * I + I - 2);
    case NonFiniteSite::kSharedGate:
      return where + put(rank.w_shared_gate, 2 * H + 3);
    case NonFiniteSite::kSharedUp:
      return where + put(rank.w_shared_up, (Is - 1) * H + H / 2);
    case NonFiniteSite::kSharedDown:
      return where + put(rank.w_shared_down, (H - 1) * Is + 1);
    case NonFiniteSite::kDOut:
      return where + put(rank.d_out, hole * H);
    case NonFiniteSite::kRouterWeight:
      rank.router_weights[twice * K + 1] = value;
      return where + " at slot " + std::to_string(twice * K + 1);
    case NonFiniteSite::kUnroutedRouterWeight:
      rank.router_weights[hole * K + K - 1] = value;
      return where + " at slot " + std::to_string(hole * K + K - 1);
  }
  return where;
}

enum class ValueClass { kFinite, kNaN, kPositiveInf, kNegativeInf };

template <typename T>
ValueClass value_class(T value) {
  const double v = as_double(value);
  if (std::isnan(v)) return ValueClass::kNaN;
  if (std::isinf(v)) return v > 0 ? ValueClass::kPositiveInf : ValueClass::kNegativeInf;
  return ValueClass::kFinite;
}

// `got` against `want` element by element: how many of `want`'s elements are non-finite, how
// many elements differ in class (finite, NaN, +inf, -inf), the first of them, and the relative
// error over the elements that are finite in both.
struct PatternComparison {
  int64_t non_finite = 0;
  int64_t mismatches = 0;
  int64_t first_mismatch = -1;
  double finite_error = 0;
};

template <typename A, typename B>
PatternComparison compare_patterns(const std::vector<A>& got, const std::vector<B>& want) {
  PatternComparison result;
  if (got.size() != want.size()) {
    result.mismatches = 1;
    result.first_mismatch = 0;
    return result;
  }
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const ValueClass a = value_class(got[i]), b = value_class(want[i]);
    result.non_finite += b != ValueClass::kFinite;
    if (a != b) {
      if (result.mismatches++ == 0) result.first_mismatch = static_cast<int64_t>(i);
      continue;
    }
    if (a != ValueClass::kFinite) continue;
    const double x = as_double(got[i]), y = as_double(want[i]);
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  result.finite_error = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
  return result;
}

// Expects `got` to hold NaN and infinities exactly where `want` does and its finite elements
// within `tolerance`; returns how many non-finite elements `want` has.
template <typename A, typename B>
int64_t expect_same_pattern(const std::string& what, const std::vector<A>& got,
                            const std::vector<B>& want, double tolerance) {
  const PatternComparison c = compare_patterns(got, want);
  EXPECT_EQ(c.mismatches, 0) << what << ": " << c.mismatches << " of " << want.size()
                             << " elements differ in class (finite / NaN / +inf / -inf), first at "
                             << c.first_mismatch << ": got "
                             << (c.first_mismatch >= 0 && c.first_mismatch < int64_t(got.size())
                                     ? as_double(got[c.first_mismatch])
                                     : 0.0)
                             << ", want "
                             << (c.first_mismatch >= 0 && c.first_mismatch < int64_t(want.size())
                                     ? as_double(want[c.first_mismatch])
                                     : 0.0);
  EXPECT_LE(c.finite_error, tolerance) << what << ": the finite elements";
  return c.non_finite;
}

}  // namespace mok::test
