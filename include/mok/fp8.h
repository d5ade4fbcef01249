// FP8 (OCP E4M3, "e4m3fn") values and the block-scaled quantization of mok's FP8 path
// (MoeConfig::precision = kFP8Block).
//
// E4M3: 1 sign, 4 exponent (bias 7) and 3 mantissa bits; finite values up to 448, subnormals
// down to 2^-9, no infinities, NaN = 0x7F / 0xFF. float_to_e4m3 rounds to nearest, ties to even,
// saturating finite overflow and infinities to +-448 and every NaN to 0x7F: what CUDA's
// cvt.rn.satfinite.e4m3x2.f32 (and __nv_cvt_float_to_fp8 with __NV_SATFINITE) does, so the CPU
// reference and the GPU kernels quantize identically.
//
// Block scaling (the DeepSeek-V3 recipe, with power-of-two scales): one fp32 scale per group of
// 128 consecutive values of a row (activations, 1 x 128) or per 128 x 128 block (weights). A
// group with largest magnitude `amax` gets the smallest power of two `scale` with
// amax / scale <= 448, and is stored as q = e4m3(x / scale), so x ~ q * scale. Scaling by a power
// of two is exact both ways, so q's only error is e4m3's rounding (the same relative precision
// as an exact amax / 448 scale: the group's largest value lands in [224, 448] instead of at
// 448). And a value that moves by an ulp moves its group's scale only when amax crosses a power
// of two, not every time: the GPU's GEMMs, whose block sums differ from fp32 in the last bits,
// then requantize their outputs as the CPU reference does (docs/design.md, "FP8 scales"). amax
// is clamped below at kFp8MinAmax (2^-100) so that a zero or denormal group keeps finite factors
// (its values quantize to zero or small codes). No clamp from above and none at DeepGEMM's 1e-4:
// gradients of 1e-6 and smaller are common in training and keep their range.
#pragma once

#include <cstdint>
#include <cstring>

#include "mok/dtype.h"

namespace mok {

struct e4m3 {
  uint8_t bits = 0;
};
static_assert(sizeof(e4m3) == 1, "e4m3 must be 1 byte");

inline constexpr float kE4m3Max = 448.0f;
inline constexpr int64_t kFp8GroupSize = 128;  // values per scale along a row; block edge
inline constexpr float kFp8MinAmax = 7.8886090522101181e-31f;  // 2^-100
// The longest reduction of an FP8 row-tile GEMM (hidden, 2 * intermediate): a tile's weight-block
// scales along K are held in shared memory, one per 128-long block.
inline constexpr int64_t kFp8MaxReduction = 256 * kFp8GroupSize;

MOK_HOST_DEVICE inline e4m3 float_to_e4m3(float value) {
  uint32_t word;
  memcpy(&word, &value, sizeof(word));
  const uint8_t sign = static_cast<uint8_t>((word >> 24) & 0x80u);
  const uint32_t magnitude = word & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return e4m3{0x7f};                   // NaN
  if (magnitude >= 0x43e00000u) return e4m3{uint8_t(sign | 0x7e)};  // >= 448 (and inf): 448
  const int32_t exponent_field = static_cast<int32_t>(magnitude >> 23);
  const uint32_t mantissa = magnitude & 0x7fffffu;
  const int32_t exponent = exponent_field == 0 ? -126 : exponent_field - 127;
  uint32_t code;
  if (exponent >= -6) {
    // A normal e4m3 value: keep the top 3 of the 23 mantissa bits, round the other 20.
    const uint32_t kept = mantissa >> 20, rest = mantissa & 0xfffffu;
    code = (static_cast<uint32_t>(exponent + 7) << 3) | kept;
    if (rest > 0x80000u || (rest == 0x80000u && (kept & 1u))) ++code;  // may carry: still < 0x7f
  } else {
    // A subnormal e4m3 value m * 2^-9, m = |x| * 2^9 rounded (m = 8 is the smallest normal).
    const uint32_t significand = exponent_field == 0 ? mantissa : (mantissa | 0x800000u);
    const int32_t shift = 14 - exponent;  // |x| * 2^9 = significand * 2^(exponent - 14)
    if (shift > 31) return e4m3{sign};    // below 2^-10 with room to spare: zero
    const uint32_t kept = significand >> shift;
    const uint32_t rest = significand & ((1u << shift) - 1u), half = 1u << (shift - 1);
    code = kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
  }
  return e4m3{static_cast<uint8_t>(sign | code)};
}

MOK_HOST_DEVICE inline float e4m3_to_float(e4m3 value) {
  const uint32_t exponent_field = (value.bits >> 3) & 0xfu, mantissa = value.bits & 7u;
  const bool negative = (value.bits & 0x80u) != 0;
  uint32_t word;
  if ((value.bits & 0x7fu) == 0x7fu) {
    word = 0x7fc00000u;  // NaN
  } else if (exponent_field == 0) {
    if (mantissa == 0) {
      word = 0;
    } else {  // m * 2^-9: normalize into an fp32 (always a normal fp32)
      int32_t shift = 0;
      uint32_t m = mantissa;
      while ((m & 4u) == 0) {
        m <<= 1;
        ++shift;
      }
      const uint32_t exponent = static_cast<uint32_t>(127 - 7 - shift);  // 2^(-7 - shift)
      word = (exponent << 23) | ((m & 3u) << 21);
    }
  } else {
    word = ((exponent_field - 7 + 127) << 23) | (mantissa << 20);
  }
  if (negative) word |= 0x80000000u;
  float out;
  memcpy(&out, &word, sizeof(out));
  return out;
}

// The factors of one group: q = e4m3(x * inverse_scale), x ~ q * scale.
struct Fp8GroupScale {
  float scale;
  float inverse_scale;
};

MOK_HOST_DEVICE inline float fp8_float_of_bits(uint32_t word) {
  float value;
  memcpy(&value, &word, sizeof(value));
  return value;
}

// The factors of a group with largest magnitude `amax`: scale = 2^e for the smallest e with
// amax / 2^e <= 448 = 1.75 * 2^8, from amax's bits (amax = 1.m * 2^E: e = E - 8, or E - 7 when
// 1.m > 1.75), and its exact inverse 2^-e; e stays within [-108, 120], so both are normal
// floats. A group holding a NaN has a NaN amax, and NaN factors: all its values quantize to
// NaN. An infinite amax gives scale inf and inverse 0: the group dequantizes to NaN. Non-finite
// values stay visible either way.
MOK_HOST_DEVICE inline Fp8GroupScale fp8_group_scale(float amax) {
  if (amax != amax) return Fp8GroupScale{amax, amax};
  const float clamped = amax > kFp8MinAmax ? amax : kFp8MinAmax;
  uint32_t word;
  memcpy(&word, &clamped, sizeof(word));
  if (word >= 0x7f800000u) return Fp8GroupScale{clamped, 0.0f};  // inf
  const int32_t exponent = static_cast<int32_t>(word >> 23) - 127;
  const int32_t e = exponent - 8 + ((word & 0x7fffffu) > 0x600000u ? 1 : 0);
  return Fp8GroupScale{fp8_float_of_bits(static_cast<uint32_t>(e + 127) << 23),
                       fp8_float_of_bits(static_cast<uint32_t>(127 - e) << 23)};
}

// Quantizes a row-major [rows, cols] bf16 matrix in 1 x 128 groups along each row (cols a
// multiple of 128): values [rows, cols] and scales [rows, cols / 128].
void quantize_fp8_rows(const bf16* values, int64_t rows, int64_t cols, e4m3* out, float* scales);

// Quantizes a row-major [rows, cols] bf16 matrix in 128 x 128 blocks (both multiples of 128):
// values [rows, cols], scales [rows / 128, cols / 128] (one amax over each block's 16384 values).
void quantize_fp8_blocks(const bf16* values, int64_t rows, int64_t cols, e4m3* out, float* scales);

}  // namespace mok
