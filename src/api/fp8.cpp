// The host quantizers of mok/fp8.h: the CPU reference's, and the ground truth of the GPU ones.
#include "mok/fp8.h"

#include <cmath>
#include <string>

#include "mok/error.h"

namespace mok {

namespace {

void require_groups(const char* call, int64_t extent, const char* what) {
  if (extent < 0 || extent % kFp8GroupSize != 0)
    throw Error(ErrorCode::kInvalidArgument, std::string(call) + ": " + what + " = " +
                                                 std::to_string(extent) +
                                                 "; expected a multiple of 128 (the FP8 group)");
}

float magnitude(bf16 value) { return std::fabs(bf16_to_float(value)); }

// The running amax: a NaN value makes it NaN and keeps it so (std::fmax would drop it), so the
// group's scale is finite (clamped) and its NaN values quantize to NaN.
float largest(float amax, float value) {
  if (std::isnan(amax) || std::isnan(value)) return NAN;
  return value > amax ? value : amax;
}

}  // namespace

void quantize_fp8_rows(const bf16* values, int64_t rows, int64_t cols, e4m3* out, float* scales) {
  require_groups("quantize_fp8_rows", cols, "cols");
  const int64_t groups = cols / kFp8GroupSize;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const bf16* group = values + r * cols + g * kFp8GroupSize;
      float amax = 0.0f;
      for (int64_t i = 0; i < kFp8GroupSize; ++i) amax = largest(amax, magnitude(group[i]));
      const Fp8GroupScale factors = fp8_group_scale(amax);
      e4m3* quantized = out + r * cols + g * kFp8GroupSize;
      for (int64_t i = 0; i < kFp8GroupSize; ++i)
        quantized[i] = float_to_e4m3(bf16_to_float(group[i]) * factors.inverse_scale);
      scales[r * groups + g] = factors.scale;
    }
  }
}

void quantize_fp8_blocks(const bf16* values, int64_t rows, int64_t cols, e4m3* out, float* scales) {
  require_groups("quantize_fp8_blocks", rows, "rows");
  require_groups("quantize_fp8_blocks", cols, "cols");
  const int64_t block_rows = rows / kFp8GroupSize, block_cols = cols / kFp8GroupSize;
  for (int64_t br = 0; br < block_rows; ++br) {
    for (int64_t bc = 0; bc < block_cols; ++bc) {
      const int64_t r0 = br * kFp8GroupSize, c0 = bc * kFp8GroupSize;
      float amax = 0.0f;
      for (int64_t r = r0; r < r0 + kFp8GroupSize; ++r)
        for (int64_t c = c0; c < c0 + kFp8GroupSize; ++c)
          amax = largest(amax, magnitude(values[r * cols + c]));
      const Fp8GroupScale factors = fp8_group_scale(amax);
      for (int64_t r = r0; r < r0 + kFp8GroupSize; ++r)
        for (int64_t c = c0; c < c0 + kFp8GroupSize; ++c)
          out[r * cols + c] =
              float_to_e4m3(bf16_to_float(values[r * cols + c]) * factors.inverse_scale);
      scales[br * block_cols + bc] = factors.scale;
    }
  }
}

}  // namespace mok
