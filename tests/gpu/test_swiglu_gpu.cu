// SwiGLU's device math (kernels/swiglu.cuh: exp and the reciprocal on the SFU) against the exact
// math in fp64, on every bf16 gate value (65536 patterns, NaNs and infinities included), with up
// and dh_raw values drawn from every bf16 pattern too, three clamps and two router weights: each
// bf16 output h, d_u and h_w is within one bf16 ulp of the exact value rounded to bf16, and d_g
// within its bound (below); the results that differ from the exact rounding at all are counted
// and printed. The unit forms (bf16 values, no roundings), forward and backward, give the
// accumulator forms' bits for every bf16 gate.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <string>
#include <utility>

#include "kernels/stages/swiglu.cuh"
#include "kernels/stages/swiglu_backward.cuh"

namespace mok {
namespace {

struct Counts {
  unsigned long long elements;
  unsigned long long mismatches;
  unsigned long long first_bad_a, first_bad_b;
};

__device__ uint32_t bits_of(float value) { return __float_as_uint(value); }

// Element `pattern`'s operands: the gate is bf16 pattern `pattern`, up and dh_raw other patterns.
__host__ __device__ uint16_t up_pattern(uint32_t pattern) {
  return static_cast<uint16_t>((pattern * 40503u) & 0xFFFFu);
}
__host__ __device__ uint16_t dh_pattern(uint32_t pattern) {
  return static_cast<uint16_t>((pattern * 25173u + 13849u) & 0xFFFFu);
}
__host__ __device__ float bf16_bits_to_float(uint16_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(uint32_t(bits) << 16);
#else
  const uint32_t wide = uint32_t(bits) << 16;
  float value;
  std::memcpy(&value, &wide, sizeof(value));
  return value;
#endif
}

// A bf16 pattern moved into magnitudes [2^-40, 2^41) (exponent field 0 stays zero), where the
// products of dh_raw, up and the gate's factors stay inside fp32's range: beyond it they leave it
// midway where the exact value would not, as in every earlier form of this math.
__host__ __device__ uint16_t practical_pattern(uint16_t bits) {
  const uint32_t exponent = (bits >> 7) & 0xFFu;
  if (exponent == 0) return static_cast<uint16_t>(bits & 0x8000u);
  return static_cast<uint16_t>((bits & 0x807Fu) | ((127u - 40u + exponent % 81u) << 7));
}

// The GPU's bf16 outputs for every gate pattern: h, d_g, d_u, h_w.
struct Outputs {
  float h, d_gate, d_up, weighted_hidden;
};

__device__ Outputs outputs_of(float gate, float up, float dh, float limit, float weight) {
  const kernels::SwigluGrad grad = kernels::swiglu_backward(dh, gate, up, weight, limit);
  return {kernels::round_bf16(kernels::swiglu_forward(gate, up, limit)), grad.d_gate, grad.d_up,
          grad.weighted_hidden};
}

__global__ void every_gate_kernel(float limit, float weight, Outputs* out) {
  const uint32_t pattern = blockIdx.x * blockDim.x + threadIdx.x;
  if (pattern >= 65536) return;
  out[pattern] =
      outputs_of(bf16_bits_to_float(static_cast<uint16_t>(pattern)),
                 bf16_bits_to_float(practical_pattern(up_pattern(pattern))),
                 bf16_bits_to_float(practical_pattern(dh_pattern(pattern))), limit, weight);
}

float to_bf16(double value) {  // round to nearest even through fp32 (fine at a one-ulp bound)
  return __bfloat162float(__float2bfloat16_rn(static_cast<float>(value)));
}

// bf16 values' distance in ulps (the bit patterns ordered as integers, -0 and +0 one value).
int64_t bf16_ulps_apart(float a, float b) {
  auto ordered = [](float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    const int64_t magnitude = (bits & 0x7FFFFFFFu) >> 16;
    return (bits >> 31) != 0 ? -magnitude : magnitude;
  };
  return std::llabs(ordered(a) - ordered(b));
}

struct Tally {
  int64_t checked = 0, off_exact_rounding = 0, beyond_bound = 0, flushed = 0;
  std::string first_bad;
};

// One output against its exact value: NaN where the exact math is NaN, equal where it is
// infinite, else within `bound` (absolute) of it or within one bf16 ulp of its rounding.
void check(Tally& tally, const char* what, uint32_t pattern, float got, double exact,
           double bound) {
  ++tally.checked;
  bool ok;
  if (std::isnan(exact))
    ok = std::isnan(got);
  else if (std::isinf(exact))
    ok = got == static_cast<float>(exact);
  else {
    const float rounded = to_bf16(exact);
    if (bf16_ulps_apart(got, rounded) != 0 || std::isnan(got)) ++tally.off_exact_rounding;
    ok = !std::isnan(got) &&
         (bf16_ulps_apart(got, rounded) <= 1 || std::fabs(double(got) - exact) <= bound);
  }
  if (!ok && tally.beyond_bound++ == 0)
    tally.first_bad = testing::PrintToString(what) + " at gate pattern " + std::to_string(pattern) +
                      ": got " + std::to_string(got) + ", exact " + std::to_string(exact);
}

// Every bf16 gate (and its up and dh_raw values), limit `limit`, router weight `weight`.
//   - h, d_u, h_w: within one bf16 ulp of the exact value's rounding (the SFU's few fp32 ulps
//     move a rounding at most one step);
//   - d_g = dh u s (1 + g (1 - s)): a sum of terms of opposite signs near g = -1.28, where the
//     result is far smaller than its terms, so its bound is the terms' magnitude times 2^-16
//     (the fp32 math's error on them, with |g| up to 2^7 before (1 - s) vanishes) plus one bf16
//     ulp of the result;
//   - gates below -87.3, where the reciprocal flushes sigmoid to zero (swiglu.cuh): h and d_u
//     are zero there (their exact values are below 2^-120 of |u| and |dh|), or not finite
//     where the exact math multiplies by an infinity.
// Up and dh_raw: every pattern's sign and mantissa, at magnitudes of 2^-40 .. 2^41 or zero
// (practical_pattern).
Tally check_every_gate(float limit, float weight) {
  Outputs* out = nullptr;
  EXPECT_EQ(cudaMallocManaged(&out, 65536 * sizeof(Outputs)), cudaSuccess);
  every_gate_kernel<<<256, 256>>>(limit, weight, out);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  Tally tally;
  for (uint32_t pattern = 0; pattern < 65536; ++pattern) {
    const double gate_raw = bf16_bits_to_float(static_cast<uint16_t>(pattern));
    const double up_raw = bf16_bits_to_float(practical_pattern(up_pattern(pattern)));
    const double dh_raw = bf16_bits_to_float(practical_pattern(dh_pattern(pattern)));
    const double dh = dh_raw * double(weight), lim = limit;
    const double g = std::isnan(gate_raw) ? gate_raw : std::min(gate_raw, lim);
    const double u = std::max(std::min(up_raw, lim), -lim);
    const bool gate_passes = !(gate_raw > lim), up_passes = !(std::fabs(up_raw) > lim);
    const double s = 1.0 / (1.0 + std::exp(-g));
    const double silu = std::isinf(g) && g < 0 ? std::nan("") : g * s;  // -inf / inf
    const double h = silu * u, d_up = up_passes ? dh * silu : 0.0;
    const Outputs got = out[pattern];
    if (g < -87.0) {  // (false for NaN)
      ++tally.flushed;
      for (const auto& [value, exact] : {std::pair{got.h, h}, std::pair{got.d_up, d_up}}) {
        ++tally.checked;
        const bool ok = value == 0.0f || !std::isfinite(value) ||
                        (std::isfinite(exact) && bf16_ulps_apart(value, to_bf16(exact)) <= 1);
        if (!ok && tally.beyond_bound++ == 0)
          tally.first_bad = "flushed sigmoid at gate pattern " + std::to_string(pattern);
      }
      continue;
    }
    check(tally, "h", pattern, got.h, h, 0.0);
    check(tally, "d_u", pattern, got.d_up, d_up, 0.0);
    // h_w = bf16(w h) from the GPU's own h (the check of h is above).
    check(tally, "h_w", pattern, got.weighted_hidden, double(weight) * double(got.h), 0.0);
    const double terms = std::fabs(dh * u * s) * (1.0 + std::fabs(g) * (1.0 - s));
    const double d_gate = gate_passes ? dh * u * s * (1.0 + g * (1.0 - s)) : 0.0;
    check(tally, "d_g", pattern, got.d_gate, d_gate, terms * 0x1p-16);
  }
  cudaFree(out);
  return tally;
}

TEST(SwigluGpu, EveryBf16GateIsWithinItsBoundOfTheExactMath) {
  for (const float limit : {std::numeric_limits<float>::infinity(), 7.0f, 0.5f}) {
    for (const float weight : {0.3125f, -1.5f}) {
      SCOPED_TRACE(testing::Message() << "limit " << limit << ", weight " << weight);
      const Tally tally = check_every_gate(limit, weight);
      EXPECT_EQ(tally.beyond_bound, 0) << tally.first_bad;
      EXPECT_EQ(tally.checked, 4 * 65536 - 2 * tally.flushed);
      std::cout << "  SwiGLU, limit " << limit << ", weight " << weight << ": " << tally.checked
                << " outputs, " << tally.off_exact_rounding
                << " one bf16 ulp from the exact value's rounding\n";
    }
  }
}

// Every bf16 gate with fixed up and dh_raw values (infinities among them).
__global__ void fixed_operands_kernel(float up, float dh, float limit, float weight, Outputs* out) {
  const uint32_t pattern = blockIdx.x * blockDim.x + threadIdx.x;
  if (pattern >= 65536) return;
  out[pattern] =
      outputs_of(bf16_bits_to_float(static_cast<uint16_t>(pattern)), up, dh, limit, weight);
}

// NaN, +inf, -inf or finite.
int value_class(float value) {
  return std::isnan(value) ? 0 : std::isinf(value) ? (value > 0 ? 1 : 2) : 3;
}

// The reference's fp32 SwiGLU (src/reference/expert_math.cpp), element by element.
Outputs reference_outputs(float gate, float up, float dh_raw, float limit, float weight) {
  const float g = gate > limit ? limit : gate;
  const float u = up > limit ? limit : (up < -limit ? -limit : up);
  const float denominator = 1.0f + std::exp(-g);
  const float silu = g / denominator, sig = 1.0f / denominator;
  const float h = to_bf16(silu * u), dh = weight * dh_raw;
  return {h, !(gate > limit) ? to_bf16(dh * u * sig * (1.0f + g * (1.0f - sig))) : 0.0f,
          !(std::fabs(up) > limit) ? to_bf16(dh * silu) : 0.0f, to_bf16(weight * h)};
}

// A unit of eight bf16 gate values (gate pattern 8 i .. 8 i + 7, NaN payloads and infinities
// included) and up values: swiglu_forward_unit, which leaves out the roundings of values already
// bf16, against swiglu_forward from the same values as fp32 accumulators, element by element.
__global__ void unit_kernel(float limit, Counts* counts) {
  const uint32_t unit = blockIdx.x * blockDim.x + threadIdx.x;
  if (unit >= 65536 / 8) return;
  uint16_t gate_bits[8], up_bits[8];
  for (int e = 0; e < 8; ++e) {
    const uint32_t pattern = unit * 8 + e;
    gate_bits[e] = static_cast<uint16_t>(pattern);
    up_bits[e] = static_cast<uint16_t>((pattern * 40503u) & 0xFFFFu);
  }
  uint4 gate, up, h;
  memcpy(&gate, gate_bits, sizeof(gate));
  memcpy(&up, up_bits, sizeof(up));
  h = kernels::swiglu_forward_unit(gate, up, limit);
  uint16_t h_bits[8];
  memcpy(h_bits, &h, sizeof(h));
  for (int e = 0; e < 8; ++e) {
    const float want = kernels::swiglu_forward(__uint_as_float(uint32_t(gate_bits[e]) << 16),
                                               __uint_as_float(uint32_t(up_bits[e]) << 16), limit);
    const uint16_t want_bits = __bfloat16_as_ushort(__float2bfloat16_rn(want));
    atomicAdd(&counts->elements, 1ull);
    if (want_bits != h_bits[e] && atomicAdd(&counts->mismatches, 1ull) == 0) {
      counts->first_bad_a = gate_bits[e];
      counts->first_bad_b = up_bits[e];
    }
  }
}

// A unit of eight bf16 gate values (all 65536 patterns over the grid), up values and dh_raw
// values (every pattern too, NaN payloads and infinities included), two router weights:
// swiglu_backward_vector, which rounds its outputs once in their bf16 pack and leaves out the
// rounding of the bf16 dh_raw, against swiglu_backward's accumulator form with each output
// rounded and then packed, element by element, and the vector's dot in swiglu_backward.cuh's
// step-1 order, ((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 + e7)).
__global__ void backward_unit_kernel(float limit, float weight, Counts* counts) {
  const uint32_t unit = blockIdx.x * blockDim.x + threadIdx.x;
  if (unit >= 65536 / 8) return;
  uint16_t gate_bits[8], up_bits[8], dh_bits[8];
  for (int e = 0; e < 8; ++e) {
    const uint32_t pattern = unit * 8 + e;
    gate_bits[e] = static_cast<uint16_t>(pattern);
    up_bits[e] = static_cast<uint16_t>((pattern * 40503u) & 0xFFFFu);
    dh_bits[e] = static_cast<uint16_t>((pattern * 25173u + 13849u) & 0xFFFFu);
  }
  uint4 gate, up, dh, d_gate, d_up, weighted;
  memcpy(&gate, gate_bits, sizeof(gate));
  memcpy(&up, up_bits, sizeof(up));
  memcpy(&dh, dh_bits, sizeof(dh));
  float dot = 0.0f;
  kernels::swiglu_backward_vector(gate, up, dh, weight, limit, dot, d_gate, d_up, weighted);
  uint16_t got[3][8];
  memcpy(got[0], &d_gate, sizeof(d_gate));
  memcpy(got[1], &d_up, sizeof(d_up));
  memcpy(got[2], &weighted, sizeof(weighted));
  float products[8];
  for (int e = 0; e < 8; ++e) {
    const kernels::SwigluGrad want = kernels::swiglu_backward(
        __uint_as_float(uint32_t(dh_bits[e]) << 16), __uint_as_float(uint32_t(gate_bits[e]) << 16),
        __uint_as_float(uint32_t(up_bits[e]) << 16), weight, limit);
    products[e] = want.dh_raw_times_h;
    const float wants[3] = {want.d_gate, want.d_up, want.weighted_hidden};
    for (int o = 0; o < 3; ++o) {
      atomicAdd(&counts->elements, 1ull);
      if (__bfloat16_as_ushort(__float2bfloat16_rn(wants[o])) != got[o][e] &&
          atomicAdd(&counts->mismatches, 1ull) == 0) {
        counts->first_bad_a = gate_bits[e];
        counts->first_bad_b = dh_bits[e];
      }
    }
  }
  const float want_dot = ((products[0] + products[1]) + (products[2] + products[3])) +
                         ((products[4] + products[5]) + (products[6] + products[7]));
  if (bits_of(dot) != bits_of(want_dot) && atomicAdd(&counts->mismatches, 1ull) == 0) {
    counts->first_bad_a = gate_bits[0];
    counts->first_bad_b = dh_bits[0];
  }
}

Counts run_counts(void (*launch)(Counts*)) {
  Counts* counts = nullptr;
  EXPECT_EQ(cudaMallocManaged(&counts, sizeof(Counts)), cudaSuccess);
  std::memset(counts, 0, sizeof(Counts));
  launch(counts);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Counts result = *counts;
  cudaFree(counts);
  return result;
}

TEST(SwigluGpu, UnitsOfBf16ValuesGiveTheBitsOfTheAccumulatorForm) {
  for (const float limit : {std::numeric_limits<float>::infinity(), 7.0f, 0.5f}) {
    SCOPED_TRACE(testing::Message() << "limit " << limit);
    static float launch_limit;
    launch_limit = limit;
    const Counts counts = run_counts([](Counts* c) { unit_kernel<<<32, 256>>>(launch_limit, c); });
    EXPECT_EQ(counts.mismatches, 0u) << "first: gate bits " << std::hex << counts.first_bad_a
                                     << ", up bits " << counts.first_bad_b;
    EXPECT_EQ(counts.elements, 65536u);
  }
}

TEST(SwigluGpu, BackwardUnitsOfBf16ValuesGiveTheBitsOfTheAccumulatorForm) {
  for (const float limit : {std::numeric_limits<float>::infinity(), 7.0f, 0.5f}) {
    for (const float weight : {0.3125f, -1.5f}) {
      SCOPED_TRACE(testing::Message() << "limit " << limit << ", weight " << weight);
      static float launch_limit, launch_weight;
      launch_limit = limit;
      launch_weight = weight;
      const Counts counts = run_counts(
          [](Counts* c) { backward_unit_kernel<<<32, 256>>>(launch_limit, launch_weight, c); });
      EXPECT_EQ(counts.mismatches, 0u) << "first: gate bits " << std::hex << counts.first_bad_a
                                       << ", dh_raw bits " << counts.first_bad_b;
      EXPECT_EQ(counts.elements, 3u * 65536u);
    }
  }
}

}  // namespace
}  // namespace mok

namespace mok {
namespace {

// The non-finite contract (docs/design.md, "Numerics"): with an infinite up or dh_raw, every bf16
// gate's h, d_g, d_u and h_w have the class (NaN, +inf, -inf, finite) that the reference's fp32
// math gives them, gates -88.7 .. -87.3 included, where sigmoid is subnormal (swiglu.cuh).
TEST(SwigluGpu, InfiniteOperandsGiveTheReferenceClassAtEveryGate) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  const std::pair<float, float> operands[] = {
      {kInf, 1.5f}, {-kInf, -0.75f}, {1.5f, kInf}, {0.0f, kInf}, {kInf, kInf}};
  Outputs* out = nullptr;
  ASSERT_EQ(cudaMallocManaged(&out, 65536 * sizeof(Outputs)), cudaSuccess);
  for (const float limit : {kInf, 7.0f}) {
    for (const auto& [up, dh] : operands) {
      SCOPED_TRACE(testing::Message() << "limit " << limit << ", up " << up << ", dh " << dh);
      fixed_operands_kernel<<<256, 256>>>(up, dh, limit, 0.3125f, out);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      int64_t mismatches = 0;
      std::string first;
      for (uint32_t pattern = 0; pattern < 65536; ++pattern) {
        const float gate = bf16_bits_to_float(static_cast<uint16_t>(pattern));
        const Outputs want = reference_outputs(gate, up, dh, limit, 0.3125f);
        const Outputs got = out[pattern];
        const float wants[4] = {want.h, want.d_gate, want.d_up, want.weighted_hidden};
        const float gots[4] = {got.h, got.d_gate, got.d_up, got.weighted_hidden};
        for (int o = 0; o < 4; ++o) {
          if (value_class(gots[o]) == value_class(wants[o])) continue;
          if (mismatches++ == 0)
            first = "output " + std::to_string(o) + " (h, d_g, d_u, h_w) at gate " +
                    std::to_string(gate) + ": got " + std::to_string(gots[o]) + ", reference " +
                    std::to_string(wants[o]);
        }
      }
      EXPECT_EQ(mismatches, 0) << first;
    }
  }
  cudaFree(out);
}

}  // namespace
}  // namespace mok
