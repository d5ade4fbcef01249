// The CPU reference of the whole MoE layer, forward and backward (DESIGN.md section 1), and an
// independent double-precision oracle used to check it.
//
// The reference rounds to bf16 exactly where the GPU kernels do (docs/design.md, "Rounding
// points"), accumulates in fp32 in a fixed order, and is multithreaded without changing any
// result: every output element is produced by one thread in one fixed order, so results are
// bitwise identical for any thread count.
//
// Expert parallelism is emulated in one process: `forward_ep` / `backward_ep` take one args
// struct per rank (rank r holds its own tokens and the weights of experts
// [r*E_loc, (r+1)*E_loc)), build each rank's schedule, move rows as the GPU layer does (pull
// dispatch, push combine into per-(token, k) slots, fixed-order sums at the source) and write
// each rank's outputs. With R = 1 it is the single-GPU layer.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/config.h"
#include "mok/layer_args.h"
#include "mok/shape.h"

namespace mok::reference {

struct Options {
  int num_threads = 0;  // 0 = MOK_NUM_THREADS from the environment, else all hardware threads
  // kFP8Block: every GEMM on FP8 block-scaled operands, quantized as the GPU will (H, I and Is
  // multiples of 128; src/reference/fp8_emulation.h); kBF16: the bf16 layer.
  Precision precision = Precision::kBF16;
};

// Validates everything (check_forward_args on every rank, expert ids included) before any
// output is written; throws mok::Error naming the bad argument.
void forward_ep(const MoeShape& shape, const std::vector<ForwardArgs>& rank_args,
                const Options& options = {});
void backward_ep(const MoeShape& shape, const std::vector<BackwardArgs>& rank_args,
                 const Options& options = {});

// Single-rank convenience forms (shape.num_ranks must be 1).
void forward(const MoeShape& shape, const ForwardArgs& args, const Options& options = {});
void backward(const MoeShape& shape, const BackwardArgs& args, const Options& options = {});

}  // namespace mok::reference

namespace mok::oracle {

// Straightforward double-precision implementation of the same math, written independently of
// the reference (per-token loops, no schedule, no blocking). With `round_like_kernel` it rounds
// to bf16 at the same points as the reference, so the two agree to within accumulation-order
// effects; without it, it is the exact math (used against finite differences).
// Single rank with all experts local (shape.num_ranks must be 1); outputs are double arrays:
struct Outputs {
  std::vector<double> out;                             // [T, H]
  std::vector<double> d_x;                             // [T, H]
  std::vector<double> d_router_weights;                // [T, K]
  std::vector<double> d_w_gate, d_w_up;                // [E, I, H]
  std::vector<double> d_w_down;                        // [E, H, I]
  std::vector<double> d_w_shared_gate, d_w_shared_up;  // [Is, H]
  std::vector<double> d_w_shared_down;                 // [H, Is]
};

// Inputs as double arrays (values need not be bf16-representable when round_like_kernel is
// false). top_experts [T, K], -1 = no route. d_out may be empty: then only `out` is computed
// (except with T = 0, where the backward outputs, all zero, are returned too).
struct Inputs {
  std::vector<double> x;                           // [T, H]
  std::vector<int64_t> top_experts;                // [T, K]
  std::vector<double> router_weights;              // [T, K]
  std::vector<double> w_gate, w_up;                // [E, I, H]
  std::vector<double> w_down;                      // [E, H, I]
  std::vector<double> w_shared_gate, w_shared_up;  // [Is, H] (empty when Is = 0)
  std::vector<double> w_shared_down;               // [H, Is]
  std::vector<double> d_out;                       // [T, H] or empty
};

Outputs run(const MoeShape& shape, const Inputs& inputs, bool round_like_kernel);

}  // namespace mok::oracle
