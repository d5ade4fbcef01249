// The shape of one MoE layer on one rank of an expert-parallel group, and the named shapes
// used by tests, benchmarks and the CLI (DESIGN.md section 1).
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "mok/error.h"
#include "mok/schedule.h"

namespace mok {

struct MoeShape {
  int64_t num_tokens = 0;    // T: tokens on each rank
  int64_t hidden = 0;        // H
  int64_t intermediate = 0;  // I of every routed expert
  int64_t num_experts = 0;   // E: routed experts in the whole group
  int32_t top_k = 0;         // K: routing slots per token
  int32_t num_ranks = 1;     // R: expert-parallel ranks; rank r owns experts [r*E/R, (r+1)*E/R)
  int64_t shared_intermediate = 0;  // Is of the shared expert; 0 = no shared expert
  // SwiGLU clamp limit L: gate = min(gate, L), up = clamp(up, -L, L). Infinity = no clamp.
  float swiglu_limit = std::numeric_limits<float>::infinity();

  int64_t num_local_experts() const { return num_ranks > 0 ? num_experts / num_ranks : 0; }
  bool has_shared_expert() const { return shared_intermediate > 0; }
  bool has_clamp() const { return swiglu_limit != std::numeric_limits<float>::infinity(); }
  std::string to_string() const;
};

// Limits of what this build supports; can_implement reports any shape outside them.
inline constexpr int64_t kDimAlignment = 64;  // H, I and Is must be multiples of this
inline constexpr int64_t kMaxDim = 65536;     // H, I, Is upper bound
inline constexpr int32_t kMaxTopK = 32;
inline constexpr int64_t kMaxExperts = 2048;
inline constexpr int32_t kMaxRanks = 64;
inline constexpr int64_t kMaxTokensPerRank = 1 << 20;

// Checks every field of the shape; the message names the field, its value and the valid range.
Status can_implement(const MoeShape& shape);

// The routing schedule's parameters of `shape` for expert-parallel rank `local_rank`.
ScheduleParams schedule_params(const MoeShape& shape, int32_t local_rank = 0);

// Named shapes of DESIGN.md: dsv3, dsv3_local, qwen3, kimi_slice, tiny; and the benchmark points
// dsv3_e128 (dsv3 at EP = 2: one GPU's 128 experts) and sonic_e128 (SonicMoE's own). `kimi_slice`
// has 8 experts per rank, so its num_experts is 8 * num_ranks; pass the rank count you will run.
// Throws Error(kInvalidArgument) for an unknown name, listing the known ones.
MoeShape named_shape(std::string_view name, int32_t num_ranks = 1);
std::vector<std::string> named_shape_names();

// Bytes of the bf16 weights a rank holds for this shape (routed local experts + shared expert).
int64_t weight_bytes_per_rank(const MoeShape& shape);

}  // namespace mok
