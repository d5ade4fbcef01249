// One expert's forward and backward over a block of rows (see expert_math.h). Every product
// goes through gemm_nt / dot_fixed, so each value has one fixed summation order.
#include "expert_math.h"

#include <algorithm>
#include <cmath>

#include "fp8_emulation.h"
#include "gemm_f32.h"

namespace mok::reference::detail {

namespace {

// exp of -g shared by silu and sigmoid: silu(g) = g / (1 + exp(-g)), sigmoid = 1 / (1 + exp(-g)).
inline float one_plus_exp_neg(float g) { return 1.0f + std::exp(-g); }

void round_in_place(ThreadPool& pool, float* values, int64_t rows, int64_t width) {
  pool.parallel_for(rows, [&](int64_t row) {
    float* row_values = values + row * width;
    for (int64_t col = 0; col < width; ++col) row_values[col] = round_to_bf16(row_values[col]);
  });
}

// A copy of `rows` x `cols` activation values quantized for an FP8 product when `fp8` (groups
// along each row: the product's reduction), else the values themselves.
const float* operand(ThreadPool& pool, const float* values, int64_t rows, int64_t cols, bool fp8,
                     std::vector<float>& storage) {
  if (!fp8) return values;
  storage.assign(values, values + rows * cols);
  fp8_rows_in_place(pool, storage.data(), rows, cols, cols);
  return storage.data();
}

// A matrix [rows, cols] as fp32 into `out`: bf16 values converted, or in FP8 the values of its
// 128 x 128 blocks, quantized here or given quantized, dequantized.
void load_matrix(ThreadPool& pool, const WeightMatrix& matrix, int64_t rows, int64_t cols, bool fp8,
                 float* out) {
  if (matrix.codes != nullptr) {
    fp8_dequantize_blocks(pool, matrix.codes, matrix.scales, rows, cols, out);
  } else if (fp8) {
    fp8_block_weights(pool, matrix.values, rows, cols, out);
  } else {
    convert_bf16_to_float(pool, matrix.values, rows * cols, out);
  }
}

}  // namespace

ExpertMatrices routed_matrices(const MoeShape& shape, const ForwardArgs& args, int64_t expert) {
  const int64_t matrix = shape.intermediate * shape.hidden, blocks = matrix / (128 * 128);
  auto pick = [&](const TensorView& values, const Fp8BlockWeight& fp8) {
    if (fp8.present())
      return WeightMatrix{nullptr,
                          fp8.codes.data_as<const e4m3>() + expert * fp8.codes.outer_stride(),
                          fp8.scales.data_as<const float>() + expert * blocks};
    return WeightMatrix{values.data_as<const bf16>() + expert * values.outer_stride()};
  };
  return {pick(args.w_gate, args.w_gate_fp8), pick(args.w_up, args.w_up_fp8),
          pick(args.w_down, args.w_down_fp8)};
}

ExpertMatrices shared_matrices(const ForwardArgs& args) {
  auto pick = [](const TensorView& values, const Fp8BlockWeight& fp8) {
    if (fp8.present())
      return WeightMatrix{nullptr, fp8.codes.data_as<const e4m3>(),
                          fp8.scales.data_as<const float>()};
    return WeightMatrix{values.data_as<const bf16>()};
  };
  return {pick(args.w_shared_gate, args.w_shared_gate_fp8),
          pick(args.w_shared_up, args.w_shared_up_fp8),
          pick(args.w_shared_down, args.w_shared_down_fp8)};
}

void load_expert_weights(ThreadPool& pool, const ExpertMatrices& matrices, int64_t hidden,
                         int64_t intermediate, WeightsFor use, bool fp8, ExpertWeights& weights) {
  weights.hidden = hidden;
  weights.intermediate = intermediate;
  weights.fp8 = fp8;
  const int64_t matrix = intermediate * hidden;
  weights.gate_up.resize(static_cast<size_t>(2 * matrix));
  load_matrix(pool, matrices.gate, intermediate, hidden, fp8, weights.gate_up.data());
  load_matrix(pool, matrices.up, intermediate, hidden, fp8, weights.gate_up.data() + matrix);
  std::vector<float>& down = use == WeightsFor::kForward ? weights.down : weights.staging;
  down.resize(static_cast<size_t>(matrix));
  load_matrix(pool, matrices.down, hidden, intermediate, fp8, down.data());
  if (use == WeightsFor::kForward) return;
  // dh_raw[i] = sum_n d_out[n] * Wd[n][i] and dx[h] = sum_i d_g[i] Wg[i][h] + d_u[i] Wu[i][h]
  // reduce over the weights' other index: transposed copies make them NT products too.
  weights.down_t.resize(static_cast<size_t>(matrix));
  transpose_to_float(pool, down.data(), hidden, intermediate, intermediate, weights.down_t.data(),
                     hidden);
  weights.gate_up_t.resize(static_cast<size_t>(2 * matrix));
  transpose_to_float(pool, weights.gate_up.data(), intermediate, hidden, hidden,
                     weights.gate_up_t.data(), 2 * intermediate);
  transpose_to_float(pool, weights.gate_up.data() + matrix, intermediate, hidden, hidden,
                     weights.gate_up_t.data() + intermediate, 2 * intermediate);
}

SwigluRows expert_swiglu(ThreadPool& pool, const ExpertWeights& weights, const float* x_rows,
                         int64_t rows, float swiglu_limit) {
  const int64_t hidden = weights.hidden, inter = weights.intermediate;
  std::vector<float> gate_up(static_cast<size_t>(rows * 2 * inter)), x_fp8;
  gemm_nt(pool, rows, 2 * inter, hidden, operand(pool, x_rows, rows, hidden, weights.fp8, x_fp8),
          hidden, weights.gate_up.data(), hidden, gate_up.data(), 2 * inter);

  SwigluRows act;
  const size_t count = static_cast<size_t>(rows * inter);
  act.gate.resize(count);
  act.up.resize(count);
  act.gate_passes.resize(count);
  act.up_passes.resize(count);
  act.hidden.resize(count);
  const float limit = swiglu_limit;
  pool.parallel_for(rows, [&](int64_t row) {
    for (int64_t i = 0; i < inter; ++i) {
      const int64_t at = row * inter + i;
      const float g = round_to_bf16(gate_up[row * 2 * inter + i]);
      const float u = round_to_bf16(gate_up[row * 2 * inter + inter + i]);
      // Strict comparisons: a value equal to the limit is not clamped and passes its gradient.
      const bool gate_clamped = g > limit;
      const bool up_clamped = u > limit || u < -limit;
      const float g_clamped = gate_clamped ? limit : g;
      const float u_clamped = u > limit ? limit : (u < -limit ? -limit : u);
      act.gate[at] = g_clamped;
      act.up[at] = u_clamped;
      act.gate_passes[at] = gate_clamped ? 0 : 1;
      act.up_passes[at] = up_clamped ? 0 : 1;
      const float silu = g_clamped / one_plus_exp_neg(g_clamped);
      act.hidden[at] = round_to_bf16(silu * u_clamped);
    }
  });
  return act;
}

void expert_down(ThreadPool& pool, const ExpertWeights& weights, const float* hidden, int64_t rows,
                 float* y) {
  const int64_t hidden_size = weights.hidden, inter = weights.intermediate;
  std::vector<float> hidden_fp8;
  gemm_nt(pool, rows, hidden_size, inter,
          operand(pool, hidden, rows, inter, weights.fp8, hidden_fp8), inter, weights.down.data(),
          inter, y, hidden_size);
  round_in_place(pool, y, rows, hidden_size);
}

WeightGradOut weight_grad_out(const TensorView& view, int64_t expert, bool accumulate) {
  WeightGradOut out;
  out.dtype = view.dtype;
  out.accumulate = accumulate;
  out.data = static_cast<char*>(view.data) + expert * view.outer_stride() * dtype_size(view.dtype);
  return out;
}

namespace {

// out = sums (null: zeros) rounded to out's dtype, or round(old + sum) when it accumulates.
void store_weight_grad(ThreadPool& pool, const float* sums, int64_t count,
                       const WeightGradOut& out) {
  constexpr int64_t kChunk = 4096;
  pool.parallel_for((count + kChunk - 1) / kChunk, [&](int64_t chunk) {
    const int64_t end = std::min(count, (chunk + 1) * kChunk);
    for (int64_t i = chunk * kChunk; i < end; ++i) {
      float value = sums != nullptr ? sums[i] : 0.0f;
      if (out.dtype == DType::kFloat32) {
        float* at = static_cast<float*>(out.data) + i;
        *at = out.accumulate ? *at + value : value;
      } else {
        bf16* at = static_cast<bf16*>(out.data) + i;
        *at = float_to_bf16(out.accumulate ? bf16_to_float(*at) + value : value);
      }
    }
  });
}

// out [rows, cols] = a [rows, depth] . b [cols, depth]^T, stored as store_weight_grad does (bf16
// written: gemm_nt's own rounding, without an fp32 copy).
void weight_grad_gemm(ThreadPool& pool, int64_t rows, int64_t cols, int64_t depth, const float* a,
                      const float* b, const WeightGradOut& out) {
  if (out.dtype == DType::kBFloat16 && !out.accumulate) {
    gemm_nt(pool, rows, cols, depth, a, depth, b, depth, static_cast<bf16*>(out.data), cols);
    return;
  }
  std::vector<float> sums(static_cast<size_t>(rows * cols));
  gemm_nt(pool, rows, cols, depth, a, depth, b, depth, sums.data(), cols);
  store_weight_grad(pool, sums.data(), rows * cols, out);
}

}  // namespace

void expert_backward(ThreadPool& pool, const ExpertWeights& weights, const float* x_rows,
                     const float* d_out_rows, const float* row_weights, int64_t rows,
                     float swiglu_limit, const ExpertGradients& grads) {
  const int64_t hidden = weights.hidden, inter = weights.intermediate;
  const bool weight_gradients = grads.d_w_gate.data != nullptr;  // null: frozen weights
  if (rows == 0) {
    // An expert nobody routed to: its gradients are zero (the outputs are still written).
    if (!weight_gradients) return;
    for (const WeightGradOut* out : {&grads.d_w_gate, &grads.d_w_up, &grads.d_w_down})
      store_weight_grad(pool, nullptr, inter * hidden, *out);
    return;
  }
  const SwigluRows act = expert_swiglu(pool, weights, x_rows, rows, swiglu_limit);

  // dh_raw = bf16(d_out . Wd[:, i]): the unweighted dgrad of down.
  std::vector<float> dh_raw(static_cast<size_t>(rows * inter)), d_out_fp8;
  gemm_nt(pool, rows, inter, hidden,
          operand(pool, d_out_rows, rows, hidden, weights.fp8, d_out_fp8), hidden,
          weights.down_t.data(), hidden, dh_raw.data(), inter);
  round_in_place(pool, dh_raw.data(), rows, inter);

  // d_router_weights = <dh_raw, h>: computed directly, right for zero and negative weights.
  if (grads.d_router_weights != nullptr)
    pool.parallel_for(rows, [&](int64_t row) {
      grads.d_router_weights[row] =
          dot_fixed(dh_raw.data() + row * inter, act.hidden.data() + row * inter, inter);
    });

  // SwiGLU backward in fp32 on the clamped bf16 g, u; d_g and d_u side by side in one row of
  // 2I, the operand of the fused dx reduction.
  std::vector<float> d_gate_up(static_cast<size_t>(rows * 2 * inter));
  std::vector<float> weighted_hidden(static_cast<size_t>(rows * inter));
  pool.parallel_for(rows, [&](int64_t row) {
    const float weight = row_weights != nullptr ? row_weights[row] : 1.0f;
    float* d_gate = d_gate_up.data() + row * 2 * inter;
    float* d_up = d_gate + inter;
    for (int64_t i = 0; i < inter; ++i) {
      const int64_t at = row * inter + i;
      const float dh = weight * dh_raw[at];
      const float g = act.gate[at];
      const float u = act.up[at];
      const float denominator = one_plus_exp_neg(g);
      const float silu = g / denominator;
      const float sigmoid = 1.0f / denominator;
      d_up[i] = act.up_passes[at] ? round_to_bf16(dh * silu) : 0.0f;
      d_gate[i] = act.gate_passes[at]
                      ? round_to_bf16(dh * u * sigmoid * (1.0f + g * (1.0f - sigmoid)))
                      : 0.0f;
      weighted_hidden[at] = round_to_bf16(weight * act.hidden[at]);
    }
  });

  // dx = bf16(d_g . Wg[:, h] + d_u . Wu[:, h]): one reduction over 2I, rounded once.
  std::vector<float> d_gate_up_fp8;
  gemm_nt(pool, rows, hidden, 2 * inter,
          operand(pool, d_gate_up.data(), rows, 2 * inter, weights.fp8, d_gate_up_fp8), 2 * inter,
          weights.gate_up_t.data(), 2 * inter, grads.dx, hidden);
  d_gate_up_fp8 = {};
  round_in_place(pool, grads.dx, rows, hidden);
  if (!weight_gradients) return;

  // Weight gradients reduce over the rows: transposed copies make the rows the depth of an NT
  // product, summed in row order.
  std::vector<float> d_out_t(static_cast<size_t>(hidden * rows));
  std::vector<float> hidden_t(static_cast<size_t>(inter * rows));
  transpose_to_float(pool, d_out_rows, rows, hidden, hidden, d_out_t.data(), rows);
  transpose_to_float(pool, weighted_hidden.data(), rows, inter, inter, hidden_t.data(), rows);
  if (weights.fp8) {  // FP8 weight gradients reduce over the rows: groups of 128 rows
    fp8_rows_in_place(pool, d_out_t.data(), hidden, rows, rows);
    fp8_rows_in_place(pool, hidden_t.data(), inter, rows, rows);
  }
  weight_grad_gemm(pool, hidden, inter, rows, d_out_t.data(), hidden_t.data(), grads.d_w_down);
  d_out_t = {};
  hidden_t = {};

  std::vector<float> d_gate_up_t(static_cast<size_t>(2 * inter * rows));
  std::vector<float> x_t(static_cast<size_t>(hidden * rows));
  transpose_to_float(pool, d_gate_up.data(), rows, 2 * inter, 2 * inter, d_gate_up_t.data(), rows);
  transpose_to_float(pool, x_rows, rows, hidden, hidden, x_t.data(), rows);
  if (weights.fp8) {
    fp8_rows_in_place(pool, d_gate_up_t.data(), 2 * inter, rows, rows);
    fp8_rows_in_place(pool, x_t.data(), hidden, rows, rows);
  }
  weight_grad_gemm(pool, inter, hidden, rows, d_gate_up_t.data(), x_t.data(), grads.d_w_gate);
  weight_grad_gemm(pool, inter, hidden, rows, d_gate_up_t.data() + inter * rows, x_t.data(),
                   grads.d_w_up);
}

}  // namespace mok::reference::detail
