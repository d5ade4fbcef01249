#include "mok/testing/routing.h"

#include <algorithm>
#include <cmath>

#include "mok/error.h"

namespace mok {

namespace {

struct KindName {
  RoutingKind kind;
  const char* name;
};

constexpr KindName kKindNames[] = {
    {RoutingKind::kUniform, "uniform"},    {RoutingKind::kHoles, "holes"},
    {RoutingKind::kSkewed, "skewed"},      {RoutingKind::kOneExpert, "one_expert"},
    {RoutingKind::kOneRank, "one_rank"},   {RoutingKind::kEmptyRank, "empty_rank"},
    {RoutingKind::kNoRoutes, "no_routes"},
};

// Picks `top_k` distinct experts from [lo, hi) for one token; when fewer than top_k experts are
// available the remaining slots cycle through them again (duplicates), as kOneRank documents.
void pick_distinct(SplitMix64& rng, int32_t lo, int32_t hi, const std::vector<double>* cdf,
                   int32_t top_k, int32_t* slots) {
  const int32_t count = hi - lo;
  for (int32_t k = 0; k < top_k; ++k) {
    if (k >= count) {
      slots[k] = slots[k % count];
      continue;
    }
    for (;;) {
      int32_t expert;
      if (cdf != nullptr) {
        double u = rng.uniform();
        expert =
            lo + static_cast<int32_t>(std::upper_bound(cdf->begin(), cdf->end(), u) - cdf->begin());
        expert = std::min(expert, hi - 1);
      } else {
        expert = lo + static_cast<int32_t>(rng.below(static_cast<uint64_t>(count)));
      }
      if (std::find(slots, slots + k, expert) == slots + k) {
        slots[k] = expert;
        break;
      }
    }
  }
}

}  // namespace

const char* routing_kind_name(RoutingKind kind) {
  for (const auto& entry : kKindNames)
    if (entry.kind == kind) return entry.name;
  return "unknown";
}

RoutingKind routing_kind_from_name(std::string_view name) {
  std::string valid;
  for (const auto& entry : kKindNames) {
    if (name == entry.name) return entry.kind;
    valid += valid.empty() ? "" : ", ";
    valid += entry.name;
  }
  throw Error(ErrorCode::kInvalidArgument,
              "routing kind '" + std::string(name) + "' is unknown; valid kinds: " + valid);
}

std::vector<RoutingKind> all_routing_kinds() {
  std::vector<RoutingKind> kinds;
  for (const auto& entry : kKindNames) kinds.push_back(entry.kind);
  return kinds;
}

std::vector<int32_t> generate_routing(RoutingKind kind, int32_t num_ranks, int32_t tokens_per_rank,
                                      int32_t top_k, int32_t num_experts, uint64_t seed) {
  if (num_ranks < 1 || tokens_per_rank < 0 || top_k < 1 || num_experts < num_ranks ||
      num_experts % num_ranks != 0)
    throw Error(ErrorCode::kInvalidArgument,
                "generate_routing: need num_ranks >= 1, tokens_per_rank >= 0, top_k >= 1 and "
                "num_experts a positive multiple of num_ranks; got R=" +
                    std::to_string(num_ranks) + " T=" + std::to_string(tokens_per_rank) +
                    " K=" + std::to_string(top_k) + " E=" + std::to_string(num_experts));
  const int32_t local_experts = num_experts / num_ranks;
  std::vector<int32_t> routing(static_cast<size_t>(num_ranks) * tokens_per_rank * top_k, -1);
  SplitMix64 rng(seed ^ (static_cast<uint64_t>(kind) + 1) * 0x51ed2701u);

  std::vector<double> zipf_cdf;
  if (kind == RoutingKind::kSkewed) {
    double total = 0;
    for (int32_t e = 0; e < num_experts; ++e) total += 1.0 / std::pow(e + 1.0, 1.2);
    double acc = 0;
    for (int32_t e = 0; e < num_experts; ++e) {
      acc += 1.0 / std::pow(e + 1.0, 1.2) / total;
      zipf_cdf.push_back(acc);
    }
  }

  for (int32_t rank = 0; rank < num_ranks; ++rank) {
    for (int32_t token = 0; token < tokens_per_rank; ++token) {
      int32_t* slots =
          routing.data() + (static_cast<size_t>(rank) * tokens_per_rank + token) * top_k;
      switch (kind) {
        case RoutingKind::kUniform:
        case RoutingKind::kHoles:
          pick_distinct(rng, 0, num_experts, nullptr, top_k, slots);
          if (kind == RoutingKind::kHoles)
            for (int32_t k = 0; k < top_k; ++k)
              if (rng.below(4) == 0) slots[k] = -1;
          break;
        case RoutingKind::kSkewed:
          pick_distinct(rng, 0, num_experts, &zipf_cdf, top_k, slots);
          break;
        case RoutingKind::kOneExpert:
          std::fill(slots, slots + top_k, 0);
          break;
        case RoutingKind::kOneRank:
          pick_distinct(rng, 0, local_experts, nullptr, top_k, slots);
          break;
        case RoutingKind::kEmptyRank:
          if (rank != num_ranks - 1)
            pick_distinct(rng, local_experts, num_experts, nullptr, top_k, slots);
          break;
        case RoutingKind::kNoRoutes:
          break;
      }
    }
  }
  return routing;
}

}  // namespace mok
