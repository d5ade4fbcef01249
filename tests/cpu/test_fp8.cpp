// FP8 E4M3 conversion and block quantization (mok/fp8.h). The conversion is checked against
// CUDA's own host implementation (__nv_cvt_float_to_fp8 with __NV_SATFINITE, which the GPU's
// cvt.rn.satfinite.e4m3x2.f32 matches) on every float whose low 8 bits are zero (2^24 values:
// every exponent, including subnormals, and every rounding boundary of e4m3, since its ties sit
// at bit 19 or above), on the neighbours of every tie, and on 2^22 random bit patterns; every
// code decodes to the value CUDA's conversion back gives. The quantizers: scales and codes of
// groups with known contents (zero, denormal, extreme, one large value, the power-of-two scale's
// boundary, NaN), and every value within half an e4m3 step of its scaled original.
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "mok/error.h"
#include "mok/fp8.h"
#include "mok/testing/routing.h"

namespace mok {
namespace {

float from_bits(uint32_t word) {
  float value;
  std::memcpy(&value, &word, sizeof(value));
  return value;
}

uint8_t cuda_e4m3(float value) {
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(value, __NV_SATFINITE, __NV_E4M3));
}

float cuda_decode(uint8_t code) {
  const __half_raw half = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
  return __half2float(__half(half));
}

TEST(Fp8, ConversionMatchesCudaOnEveryRoundingBoundary) {
  int64_t mismatches = 0;
  for (uint64_t high = 0; high < (1ull << 24); ++high) {
    const float value = from_bits(static_cast<uint32_t>(high << 8));
    const uint8_t got = float_to_e4m3(value).bits, want = cuda_e4m3(value);
    if (got != want && ++mismatches <= 5)
      ADD_FAILURE() << "value " << value << " (bits 0x" << std::hex << (high << 8) << "): mok 0x"
                    << int(got) << ", CUDA 0x" << int(want);
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(Fp8, ConversionMatchesCudaBesideEveryTieAndAtRandom) {
  // Each pair of adjacent finite codes: their midpoint (a tie) and one float either side of it.
  for (int code = 0; code < 0x7e; ++code) {
    for (const float sign : {1.0f, -1.0f}) {
      const double low = e4m3_to_float(e4m3{uint8_t(code)});
      const double high = e4m3_to_float(e4m3{uint8_t(code + 1)});
      const float tie = static_cast<float>((low + high) / 2) * sign;
      for (const float value : {tie, std::nextafter(tie, 0.0f), std::nextafter(tie, sign * 1e9f)})
        EXPECT_EQ(float_to_e4m3(value).bits, cuda_e4m3(value)) << value;
    }
  }
  SplitMix64 rng(123);
  for (int i = 0; i < (1 << 22); ++i) {
    const float value = from_bits(static_cast<uint32_t>(rng.next()));
    ASSERT_EQ(float_to_e4m3(value).bits, cuda_e4m3(value)) << value;
  }
  for (const float special : {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 448.0f, 449.0f, 464.0f,
                              480.0f, 1e30f, -1e30f, 0x1p-9f, 0x1p-10f, 0x1.0p-149f})
    EXPECT_EQ(float_to_e4m3(special).bits, cuda_e4m3(special)) << special;
}

TEST(Fp8, EveryCodeDecodesAsCudaDoesAndRoundTrips) {
  for (int code = 0; code < 256; ++code) {
    const float got = e4m3_to_float(e4m3{uint8_t(code)}), want = cuda_decode(uint8_t(code));
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(got) && std::isnan(want)) << code;
      continue;
    }
    EXPECT_EQ(std::memcmp(&got, &want, sizeof(got)), 0) << "code 0x" << std::hex << code;
    EXPECT_EQ(float_to_e4m3(got).bits, code) << "code 0x" << std::hex << code;  // exact: round trip
  }
}

std::vector<bf16> bf16s(const std::vector<float>& values) {
  std::vector<bf16> out;
  for (float value : values) out.push_back(float_to_bf16(value));
  return out;
}

TEST(Fp8, GroupScalesOfKnownGroups) {
  auto one_group = [](const std::vector<float>& values) {
    std::vector<float> padded(values);
    padded.resize(kFp8GroupSize, 0.0f);
    const std::vector<bf16> input = bf16s(padded);
    std::vector<e4m3> out(kFp8GroupSize);
    float scale = 0.0f;
    quantize_fp8_rows(input.data(), 1, kFp8GroupSize, out.data(), &scale);
    return std::make_pair(out, scale);
  };
  {  // zero: every code zero, a finite scale
    const auto [codes, scale] = one_group({});
    for (const e4m3 code : codes) EXPECT_EQ(code.bits, 0);
    EXPECT_TRUE(std::isfinite(scale) && scale > 0.0f);
  }
  {  // the scale: the smallest power of two that brings amax to 448 or below (6 -> 384)
    const auto [codes, scale] = one_group({3.0f, -6.0f, 0.75f});
    EXPECT_EQ(scale, 0x1p-6f);
    EXPECT_EQ(codes[1].bits, 0xfc);  // -384
    EXPECT_EQ(e4m3_to_float(codes[0]), 192.0f);
    EXPECT_EQ(e4m3_to_float(codes[2]), 48.0f);
  }
  {  // amax = 1.75 * 2^k maps to 448 exactly; above 1.75 * 2^k the next power of two
    const auto [codes, scale] = one_group({7.0f});
    EXPECT_EQ(scale, 0x1p-6f);
    EXPECT_EQ(codes[0].bits, 0x7e);  // 448
    const auto [codes_above, scale_above] = one_group({7.5f});
    EXPECT_EQ(scale_above, 0x1p-5f);
    EXPECT_EQ(e4m3_to_float(codes_above[0]), 240.0f);
  }
  {  // tiny values (2^-90, far below DeepGEMM's 1e-4 clamp): still quantized to full codes
    const auto [codes, scale] = one_group({0x1p-90f, -0x1p-91f});
    EXPECT_EQ(codes[0].bits, 0x78);  // 256
    EXPECT_EQ(codes[1].bits, 0xf0);  // -128
    EXPECT_EQ(scale, 0x1p-98f);
  }
  {  // denormal bf16 values (2^-130, below the 2^-100 clamp): zero codes, finite factors
    const auto [codes, scale] = one_group({0x1p-130f, -0x1p-131f});
    EXPECT_EQ(codes[0].bits & 0x7f, 0);
    EXPECT_EQ(codes[1].bits & 0x7f, 0);
    EXPECT_EQ(scale, 0x1p-108f);
  }
  {  // extreme: bf16's largest finite value (255 * 2^120 rounds to e4m3's 256)
    const auto [codes, scale] = one_group({3.3895314e38f, 1.0f});
    EXPECT_EQ(codes[0].bits, 0x78);
    EXPECT_EQ(codes[1].bits, 0);
    EXPECT_EQ(scale, 0x1p120f);
  }
  {  // a NaN poisons its group
    const auto [codes, scale] = one_group({1.0f, NAN});
    EXPECT_TRUE(std::isnan(scale));
    for (const e4m3 code : codes) EXPECT_EQ(code.bits & 0x7f, 0x7f);
  }
}

TEST(Fp8, QuantizedValuesAreWithinHalfAStep) {
  SplitMix64 rng(7);
  const int64_t rows = 256, cols = 384;
  std::vector<float> values(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i)  // magnitudes over 2^-20 .. 2^10
    values[i] = std::ldexp(static_cast<float>(rng.next() % 2001) / 1000.0f - 1.0f,
                           static_cast<int>(rng.next() % 31) - 20);
  const std::vector<bf16> input = bf16s(values);
  std::vector<e4m3> rows_out(rows * cols), blocks_out(rows * cols);
  std::vector<float> row_scales(rows * cols / kFp8GroupSize), block_scales(2 * 3);
  quantize_fp8_rows(input.data(), rows, cols, rows_out.data(), row_scales.data());
  quantize_fp8_blocks(input.data(), rows, cols, blocks_out.data(), block_scales.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float x = bf16_to_float(input[r * cols + c]);
      for (const auto& [codes, scale] :
           {std::make_pair(&rows_out, row_scales[r * (cols / 128) + c / 128]),
            std::make_pair(&blocks_out, block_scales[(r / 128) * (cols / 128) + c / 128])}) {
        const float scaled = x / scale, q = e4m3_to_float((*codes)[r * cols + c]);
        // Half a step of e4m3 at |scaled| (3 mantissa bits), or of its subnormals (2^-10).
        const float step = std::fmax(
            std::ldexp(1.0f, std::ilogb(std::fmax(std::fabs(scaled), 1e-30f)) - 3), 0x1p-9f);
        ASSERT_LE(std::fabs(q - scaled), step / 2 * 1.0001f) << r << ", " << c;
        ASSERT_LE(std::fabs(scaled), 448.0f * 1.0001f);
      }
    }
  }
  EXPECT_THROW(quantize_fp8_rows(input.data(), rows, 100, rows_out.data(), row_scales.data()),
               Error);
}

}  // namespace
}  // namespace mok

namespace mok {
namespace {

// A weight quantized in blocks and then transposed is the transposed weight quantized in blocks:
// each block keeps its amax and each value its code. So the dgrads' transposed operands can be
// derived from the forward's quantized weights (or from weights a caller gives pre-quantized)
// without the bf16 weights.
TEST(Fp8, TransposingBlockQuantizedWeightsIsQuantizingTheTranspose) {
  const int64_t rows = 256, cols = 384;
  SplitMix64 rng(31);
  std::vector<bf16> w(rows * cols), w_t(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float value = std::ldexp(static_cast<float>(rng.next() % 20001) / 10000.0f - 1.0f,
                                     static_cast<int>(rng.next() % 12) - 6);
      w[r * cols + c] = w_t[c * rows + r] = float_to_bf16(value);
    }
  std::vector<e4m3> codes(w.size()), codes_t(w.size());
  std::vector<float> scales(rows * cols / (128 * 128)), scales_t(scales.size());
  quantize_fp8_blocks(w.data(), rows, cols, codes.data(), scales.data());
  quantize_fp8_blocks(w_t.data(), cols, rows, codes_t.data(), scales_t.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      ASSERT_EQ(codes[r * cols + c].bits, codes_t[c * rows + r].bits) << r << ", " << c;
  for (int64_t br = 0; br < rows / 128; ++br)
    for (int64_t bc = 0; bc < cols / 128; ++bc)
      ASSERT_EQ(scales[br * (cols / 128) + bc], scales_t[bc * (rows / 128) + br]);
}

}  // namespace
}  // namespace mok
