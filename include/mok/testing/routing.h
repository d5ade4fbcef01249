// Deterministic routing generators for tests, benchmarks and the CLI: the normal case and the
// adversarial routings of DESIGN.md section 4. All use a seeded splitmix64 stream, so a
// (kind, sizes, seed) triple gives the same routing on every machine.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mok {

enum class RoutingKind {
  kUniform,    // K distinct experts per token, uniformly at random
  kHoles,      // kUniform with about a quarter of the slots set to -1
  kSkewed,     // distinct experts drawn with Zipf-like popularity (expert 0 hottest)
  kOneExpert,  // every slot of every token to expert 0 (duplicates: the true worst case)
  kOneRank,    // every token to K distinct experts of rank 0 (cycled if E_loc < K)
  kEmptyRank,  // rank R-1 sends nothing (all -1) and no token goes to rank 0's experts
  kNoRoutes,   // every slot -1
};

const char* routing_kind_name(RoutingKind kind);
RoutingKind routing_kind_from_name(std::string_view name);  // throws Error listing valid names
std::vector<RoutingKind> all_routing_kinds();

// Routing of all ranks, [R, T, K] row-major, global expert ids in [-1, E).
std::vector<int32_t> generate_routing(RoutingKind kind, int32_t num_ranks, int32_t tokens_per_rank,
                                      int32_t top_k, int32_t num_experts, uint64_t seed);

// splitmix64: the project's one random stream.
struct SplitMix64 {
  uint64_t state;
  explicit SplitMix64(uint64_t seed) : state(seed) {}
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1).
  double uniform() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  // Uniform integer in [0, bound).
  uint64_t below(uint64_t bound) { return bound == 0 ? 0 : next() % bound; }
};

}  // namespace mok
