// The math of one expert over a block of rows, forward and backward, with the rounding points
// of docs/design.md ("Numerics: the rounding points"). Routed experts and the shared expert
// (router weight 1) go through the same functions.
#pragma once

#include <cstdint>
#include <vector>

#include "mok/dtype.h"
#include "mok/fp8.h"
#include "mok/layer_args.h"
#include "mok/shape.h"
#include "thread_pool.h"

namespace mok::reference::detail {

// One expert's weights as fp32 operands in NT form, converted once per call.
struct ExpertWeights {
  int64_t hidden = 0;            // H
  int64_t intermediate = 0;      // I (or Is)
  std::vector<float> gate_up;    // [2I, H]: gate rows then up rows; one product gives g and u
  std::vector<float> down;       // [H, I] (forward only)
  std::vector<float> down_t;     // [I, H] (backward only): operand of dh_raw = d_out . Wd[:, i]
  std::vector<float> gate_up_t;  // [H, 2I] (backward only): operand of the fused dx reduction
  std::vector<float> staging;    // [H, I] (backward only): Wd before its transposition
  // FP8 block-scaled GEMMs (Precision::kFP8Block): the weights above hold their dequantized
  // 128 x 128-block values, and every activation operand is quantized in 1 x 128 groups along
  // its reduction (fp8_emulation.h) before each product.
  bool fp8 = false;
};

enum class WeightsFor { kForward, kBackward };

// One matrix of an expert as the call gives it: bf16 values, or (precision fp8_block) e4m3
// codes with one fp32 scale per 128 x 128 block (ForwardArgs's pre-quantized weights).
struct WeightMatrix {
  const bf16* values = nullptr;
  const e4m3* codes = nullptr;
  const float* scales = nullptr;
};
struct ExpertMatrices {
  WeightMatrix gate, up, down;
};

// The matrices of routed expert `expert` (local index) of `args`, and of its shared expert.
ExpertMatrices routed_matrices(const MoeShape& shape, const ForwardArgs& args, int64_t expert);
ExpertMatrices shared_matrices(const ForwardArgs& args);

// Fills `weights` (reusing its memory: experts of one call share a shape, so converting expert
// after expert allocates and page-faults only once). Pre-quantized matrices need `fp8`.
void load_expert_weights(ThreadPool& pool, const ExpertMatrices& matrices, int64_t hidden,
                         int64_t intermediate, WeightsFor use, bool fp8, ExpertWeights& weights);

// Gate, up and hidden of a block of rows, every value bf16-representable.
struct SwigluRows {
  std::vector<float> gate;           // [rows, I]: bf16(x . Wg[i]), then min(g, L)
  std::vector<float> up;             // [rows, I]: bf16(x . Wu[i]), then clamp(u, -L, L)
  std::vector<uint8_t> gate_passes;  // 1 where g was not clamped (its gradient flows)
  std::vector<uint8_t> up_passes;    // 1 where u was not clamped
  std::vector<float> hidden;         // [rows, I]: bf16(silu(g) * u)
};

SwigluRows expert_swiglu(ThreadPool& pool, const ExpertWeights& weights, const float* x_rows,
                         int64_t rows, float swiglu_limit);

// y[r] = bf16(hidden[r] . Wd[n]) for every n: [rows, H], bf16 values as fp32.
void expert_down(ThreadPool& pool, const ExpertWeights& weights, const float* hidden, int64_t rows,
                 float* y);

// Where a weight gradient goes (BackwardArgs): a dense bf16 or fp32 matrix, written with the fp32
// sums rounded once, or with `accumulate` set to round(old + sum).
struct WeightGradOut {
  void* data = nullptr;
  DType dtype = DType::kBFloat16;
  bool accumulate = false;
};
// `view`'s matrix of `expert` (a dense 2-D view: expert 0), with the call's accumulate flag.
WeightGradOut weight_grad_out(const TensorView& view, int64_t expert, bool accumulate);

// Where expert_backward writes. d_router_weights may be null (the shared expert has none), and
// so may the three weight gradients together (frozen weights: not computed).
struct ExpertGradients {
  float* d_router_weights = nullptr;  // [rows]: <dh_raw, h>, fp32
  float* dx = nullptr;                // [rows, H]: bf16 values as fp32
  WeightGradOut d_w_gate;             // [I, H]
  WeightGradOut d_w_up;               // [I, H]
  WeightGradOut d_w_down;             // [H, I]
};

// Backward of one expert over `rows` rows: recomputes g, u, h from x_rows, then dh_raw, the
// router-weight gradients, SwiGLU backward, dx rows, and the weight gradients summed over the
// rows in their order. row_weights null means every weight is 1 (the shared expert).
void expert_backward(ThreadPool& pool, const ExpertWeights& weights, const float* x_rows,
                     const float* d_out_rows, const float* row_weights, int64_t rows,
                     float swiglu_limit, const ExpertGradients& grads);

}  // namespace mok::reference::detail
