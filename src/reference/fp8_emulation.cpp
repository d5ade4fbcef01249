// FP8 operands of the CPU reference (fp8_emulation.h).
#include "fp8_emulation.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

#include "mok/error.h"
#include "mok/fp8.h"

namespace mok::reference::detail {

namespace {

float quantized(float value, const Fp8GroupScale& factors) {
  return e4m3_to_float(float_to_e4m3(value * factors.inverse_scale)) * factors.scale;
}

// The group's amax, NaN if it holds one (as the quantizers of mok/fp8.h).
float group_amax(const float* values, int64_t count) {
  float amax = 0.0f;
  for (int64_t i = 0; i < count; ++i) {
    const float magnitude = std::fabs(values[i]);
    if (std::isnan(magnitude)) return magnitude;
    amax = std::max(amax, magnitude);
  }
  return amax;
}

}  // namespace

void check_fp8_shape(const char* call, const MoeShape& shape) {
  for (const auto& [field, value] : {std::pair<const char*, int64_t>{"hidden", shape.hidden},
                                     {"intermediate", shape.intermediate},
                                     {"shared_intermediate", shape.shared_intermediate}})
    if (value % kFp8GroupSize != 0)
      throw Error(ErrorCode::kInvalidArgument, std::string(call) + ": precision fp8_block needs " +
                                                   field + " = " + std::to_string(value) +
                                                   " to be a multiple of 128 (the FP8 groups)");
}

void fp8_dequantize_blocks(ThreadPool& pool, const e4m3* codes, const float* scales, int64_t rows,
                           int64_t cols, float* out) {
  const int64_t block_cols = cols / kFp8GroupSize;
  pool.parallel_for(rows, [&](int64_t r) {
    const float* block_scales = scales + (r / kFp8GroupSize) * block_cols;
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = e4m3_to_float(codes[r * cols + c]) * block_scales[c / kFp8GroupSize];
  });
}

void fp8_block_weights(ThreadPool& pool, const bf16* values, int64_t rows, int64_t cols,
                       float* out) {
  std::vector<e4m3> codes(static_cast<size_t>(rows * cols));
  std::vector<float> scales(static_cast<size_t>(rows / kFp8GroupSize * (cols / kFp8GroupSize)));
  quantize_fp8_blocks(values, rows, cols, codes.data(), scales.data());
  fp8_dequantize_blocks(pool, codes.data(), scales.data(), rows, cols, out);
}

void fp8_rows_in_place(ThreadPool& pool, float* values, int64_t rows, int64_t cols, int64_t ld) {
  pool.parallel_for(rows, [&](int64_t row) {
    float* row_values = values + row * ld;
    for (int64_t start = 0; start < cols; start += kFp8GroupSize) {
      const int64_t count = std::min<int64_t>(kFp8GroupSize, cols - start);
      const Fp8GroupScale factors = fp8_group_scale(group_amax(row_values + start, count));
      for (int64_t i = start; i < start + count; ++i)
        row_values[i] = quantized(row_values[i], factors);
    }
  });
}

}  // namespace mok::reference::detail
