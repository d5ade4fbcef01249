// HostProblem: an owning, host-memory MoE problem for a whole expert-parallel group (every
// rank's inputs and output buffers), filled with deterministic random values. Tests and the
// CLI build one, hand its views to the CPU reference (or copy them to GPUs), and compare.
//
// Values, from the project's splitmix64 streams, one per tensor, rank and block of 2^20 values (a
// (shape, routing, seed) triple gives the same problem on every machine, with any thread count): x
// and d_out ~ U(-1, 1), weights ~ U(-1, 1) / sqrt(fan_in), all rounded to bf16; router weights ~
// U(0, 1) in fp32 (tests may overwrite some); routing from generate_routing. The shared expert is
// replicated: every rank holds the same values.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/dtype.h"
#include "mok/fp8.h"
#include "mok/layer_args.h"
#include "mok/reference.h"
#include "mok/shape.h"
#include "mok/testing/routing.h"

namespace mok {

// One rank's tensors, row-major. E_loc = local experts, Is = shared intermediate.
struct HostRank {
  // Inputs.
  std::vector<bf16> x;                           // [T, H]
  std::vector<bf16> d_out;                       // [T, H]
  std::vector<int32_t> top_experts;              // [T, K], global ids, -1 = no route
  std::vector<float> router_weights;             // [T, K]
  std::vector<bf16> w_gate, w_up;                // [E_loc, I, H]
  std::vector<bf16> w_down;                      // [E_loc, H, I]
  std::vector<bf16> w_shared_gate, w_shared_up;  // [Is, H] (empty when Is = 0)
  std::vector<bf16> w_shared_down;               // [H, Is]
  // Outputs.
  std::vector<bf16> out;                             // [T, H]
  std::vector<bf16> d_x;                             // [T, H]
  std::vector<float> d_router_weights;               // [T, K]
  std::vector<bf16> d_w_gate, d_w_up;                // [E_loc, I, H]
  std::vector<bf16> d_w_down;                        // [E_loc, H, I]
  std::vector<bf16> d_w_shared_gate, d_w_shared_up;  // [Is, H]
  std::vector<bf16> d_w_shared_down;                 // [H, Is]
};

// Calls fn(name, member) for every output of a HostRank, in the layer's order: `member` is a
// pointer to the HostRank field (std::vector<bf16> or std::vector<float>).
template <typename Fn>
void for_each_output_field(Fn&& fn) {
  fn("out", &HostRank::out);
  fn("d_x", &HostRank::d_x);
  fn("d_router_weights", &HostRank::d_router_weights);
  fn("d_w_gate", &HostRank::d_w_gate);
  fn("d_w_up", &HostRank::d_w_up);
  fn("d_w_down", &HostRank::d_w_down);
  fn("d_w_shared_gate", &HostRank::d_w_shared_gate);
  fn("d_w_shared_up", &HostRank::d_w_shared_up);
  fn("d_w_shared_down", &HostRank::d_w_shared_down);
}

struct HostProblem {
  MoeShape shape;
  std::vector<HostRank> ranks;  // shape.num_ranks entries

  // Builds and fills a problem; throws mok::Error if can_implement(shape) fails.
  static HostProblem make(const MoeShape& shape, RoutingKind routing, uint64_t seed);

  // Host bytes that make() allocates for `shape` (inputs and outputs of every rank), so a
  // caller can refuse a shape that does not fit in memory before trying.
  static int64_t bytes_needed(const MoeShape& shape);

  // Views into rank `rank`'s buffers (int32 top_experts, CPU device).
  ForwardArgs forward_args(int32_t rank);
  BackwardArgs backward_args(int32_t rank);
  std::vector<ForwardArgs> all_forward_args();
  std::vector<BackwardArgs> all_backward_args();

  // The same math on one rank: R = 1, all E experts local (ranks' experts in rank order), the
  // ranks' tokens concatenated in rank order. Outputs are allocated, not filled.
  HostProblem single_rank_equivalent() const;
  // R = 1 with all experts and only rank `rank`'s tokens: its shared-expert weight gradients
  // are what rank `rank` computes in the R-rank problem.
  HostProblem rank_alone(int32_t rank) const;

  // R = 1 only: a problem holding `tokens` (in that order) with the same weights; outputs are
  // allocated, not filled. Each token's out, d_x and d_router_weights depend on that token
  // only, so checks on a slice of a large problem are exact checks of those outputs.
  HostProblem token_slice(const std::vector<int64_t>& tokens) const;

  // Any R: the R = 1 problem of `group_tokens` (rank * num_tokens + token, in that order) with
  // only the experts they route to, renumbered 0, 1, ... in id order (E' of them). Its out, d_x
  // and d_router_weights equal those of single_rank_equivalent().token_slice() bit for bit,
  // without copying every expert's weights: the CLI checks `dsv3` slices with it.
  HostProblem reference_slice(const std::vector<int64_t>& group_tokens) const;

  // Fills every output buffer with NaN (a recognizable payload), so that an element a run
  // fails to write shows up in any comparison.
  void poison_outputs();

  // The inputs as mok::oracle::Inputs (d_out included). Needs shape.num_ranks == 1.
  oracle::Inputs to_oracle_inputs() const;
};

// One rank's six weights quantized as ForwardArgs's pre-quantized weights (mok/fp8.h's
// 128 x 128 blocks, expert by expert), in the order gate, up, down, shared gate, shared up,
// shared down (the shared ones empty when the shape has none). H, I and Is multiples of 128.
struct HostFp8Weights {
  static constexpr int kCount = 6;
  std::vector<e4m3> codes[kCount];
  std::vector<float> scales[kCount];
  static HostFp8Weights quantize(const MoeShape& shape, const HostRank& rank);
};

// Gives `args` its weights pre-quantized: views over codes[i] and scales[i] (in
// HostFp8Weights's order; host vectors or device copies, on args.x's device) for each weight
// whose bit is set in `which` (bit i = weight i; the shared ones only where the shape has a
// shared expert), their bf16 views made absent.
void give_fp8_weights(const MoeShape& shape, ForwardArgs& args,
                      const void* const codes[HostFp8Weights::kCount],
                      const float* const scales[HostFp8Weights::kCount], unsigned which = 0x3f);
// The same over the host vectors of `weights` (CPU tensors).
void give_fp8_weights(const MoeShape& shape, ForwardArgs& args, const HostFp8Weights& weights,
                      unsigned which = 0x3f);

// The gate and up codes of `weights` side by side per expert, [E, 2I, H] (expert e: its gate
// rows, then its up rows), as a fused checkpoint tensor holds them (Hugging Face's FP8
// gate_up_proj).
std::vector<e4m3> fused_gate_up_codes(const MoeShape& shape, const HostFp8Weights& weights);
// Points `args`'s pre-quantized gate and up codes at the halves of `fused` ([E, 2I, H] in
// fused_gate_up_codes's layout, on args.x's device): expert-strided views, 2IH codes apart. The
// scales stay as they were given.
void give_fused_gate_up_codes(const MoeShape& shape, ForwardArgs& args, const void* fused);

// Sizes (zero-filled) every output buffer of `rank` for one rank of `shape`.
void allocate_outputs(const MoeShape& shape, HostRank& rank);
// A rank holding only output buffers, sized for one rank of `shape`: what a run downloads into
// (copying a whole HostRank would copy its weights too).
HostRank output_buffers(const MoeShape& shape);
// True when every output of `a` and `b` holds the same bits.
bool outputs_equal(const HostRank& a, const HostRank& b);

// The poison values of HostProblem::poison_outputs.
inline constexpr uint16_t kPoisonBf16Bits = 0xFFC1;
inline constexpr uint32_t kPoisonF32Bits = 0xFFC0BAD1u;

}  // namespace mok
