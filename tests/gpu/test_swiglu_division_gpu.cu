// The branch-free division of the SwiGLU steps (kernels/swiglu.cuh) gives the bits of `a / b`:
// on random operands across its whole range, and on every bf16 gate value through the forward
// and backward SwiGLU (g is bf16, so 65536 values are all of them), with and without a clamp;
// out of its range it says so, and the callers' fallback then gives `a / b` itself. The unit forms
// (bf16 values, no roundings), forward and backward, give the accumulator forms' bits for every
// bf16 gate.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/stages/swiglu.cuh"
#include "kernels/stages/swiglu_backward.cuh"

namespace mok {
namespace {

struct Counts {
  unsigned long long in_range;
  unsigned long long practical_out_of_range;  // zero or 2^-60 <= |gate| <= 32, yet out of range
  unsigned long long mismatches;              // in range, but bits unlike `a / b`'s
  unsigned long long first_bad_a, first_bad_b;
};

__device__ uint32_t bits_of(float value) { return __float_as_uint(value); }

// Operands from a 64-bit hash of the index: |a| in [2^-64, 2^64] (either sign, zeros included),
// b in [2^-2, 2^64], so both sides of the range's edges are hit.
__global__ void random_division_kernel(uint64_t count, Counts* counts) {
  for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<uint64_t>(gridDim.x) * blockDim.x) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    const uint32_t a_exponent = 127 - 64 + static_cast<uint32_t>(h % 129);
    const uint32_t b_exponent = 127 - 2 + static_cast<uint32_t>((h >> 8) % 67);
    const uint32_t a_bits = (static_cast<uint32_t>(h >> 16) & 0x80000000u) | (a_exponent << 23) |
                            (static_cast<uint32_t>(h >> 20) & 0x7FFFFFu);
    const uint32_t b_bits = (b_exponent << 23) | (static_cast<uint32_t>(h >> 41) & 0x7FFFFFu);
    const float a = (i % 1021 == 0) ? ((i & 1) ? -0.0f : 0.0f) : __uint_as_float(a_bits);
    const float b = __uint_as_float(b_bits);
    bool in_range = true;
    const float fast = kernels::divide_in_range(a, b, in_range);
    if (!in_range) continue;
    atomicAdd(&counts->in_range, 1ull);
    if (bits_of(fast) != bits_of(a / b) && atomicAdd(&counts->mismatches, 1ull) == 0) {
      counts->first_bad_a = bits_of(a);
      counts->first_bad_b = bits_of(b);
    }
  }
}

// Every bf16 gate value (and its negative's up value), forward and backward, clamp `limit`.
__global__ void every_gate_kernel(float limit, Counts* counts) {
  const uint32_t pattern = blockIdx.x * blockDim.x + threadIdx.x;
  if (pattern >= 65536) return;
  const float gate = __uint_as_float(pattern << 16);
  const float up = __uint_as_float(((pattern * 40503u) & 0xFFFFu) << 16);
  const float dh = 0.75f - gate * 0.001f, weight = 0.3125f;
  bool in_range = true;
  const float fast_h = kernels::swiglu_forward<true>(gate, up, limit, in_range);
  const kernels::SwigluGrad fast =
      kernels::swiglu_backward<true>(dh, gate, up, weight, limit, in_range);
  const float magnitude = fabsf(gate);
  const bool practical = gate == 0.0f || (magnitude >= 0x1p-60f && magnitude <= 32.0f);
  if (practical && !in_range) atomicAdd(&counts->practical_out_of_range, 1ull);
  if (!in_range) return;
  atomicAdd(&counts->in_range, 1ull);
  bool unused = true;
  const float exact_h = kernels::swiglu_forward(gate, up, limit);
  const kernels::SwigluGrad exact =
      kernels::swiglu_backward<false>(dh, gate, up, weight, limit, unused);
  const bool same = bits_of(fast_h) == bits_of(exact_h) &&
                    bits_of(fast.dh_raw_times_h) == bits_of(exact.dh_raw_times_h) &&
                    bits_of(fast.d_gate) == bits_of(exact.d_gate) &&
                    bits_of(fast.d_up) == bits_of(exact.d_up) &&
                    bits_of(fast.weighted_hidden) == bits_of(exact.weighted_hidden);
  if (!same && atomicAdd(&counts->mismatches, 1ull) == 0) {
    counts->first_bad_a = bits_of(gate);
    counts->first_bad_b = bits_of(up);
  }
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
  if (!kernels::swiglu_forward_unit<true>(gate, up, limit, h))
    kernels::swiglu_forward_unit<false>(gate, up, limit, h);
  uint16_t h_bits[8];
  memcpy(h_bits, &h, sizeof(h));
  for (int e = 0; e < 8; ++e) {
    const float want = kernels::swiglu_forward(__uint_as_float(uint32_t(gate_bits[e]) << 16),
                                               __uint_as_float(uint32_t(up_bits[e]) << 16), limit);
    const uint16_t want_bits = __bfloat16_as_ushort(__float2bfloat16_rn(want));
    atomicAdd(&counts->in_range, 1ull);
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
// rounded and then packed, element by element, and the dot summed in the same order.
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
  float want_dot = 0.0f;
  for (int e = 0; e < 8; ++e) {
    bool unused = true;
    const kernels::SwigluGrad want = kernels::swiglu_backward<false>(
        __uint_as_float(uint32_t(dh_bits[e]) << 16), __uint_as_float(uint32_t(gate_bits[e]) << 16),
        __uint_as_float(uint32_t(up_bits[e]) << 16), weight, limit, unused);
    want_dot += want.dh_raw_times_h;
    const float wants[3] = {want.d_gate, want.d_up, want.weighted_hidden};
    for (int o = 0; o < 3; ++o) {
      atomicAdd(&counts->in_range, 1ull);
      if (__bfloat16_as_ushort(__float2bfloat16_rn(wants[o])) != got[o][e] &&
          atomicAdd(&counts->mismatches, 1ull) == 0) {
        counts->first_bad_a = gate_bits[e];
        counts->first_bad_b = dh_bits[e];
      }
    }
  }
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

TEST(SwigluDivisionGpu, BranchFreeDivisionHasTheBitsOfIeeeDivision) {
  constexpr uint64_t kCount = 1ull << 26;
  const Counts counts =
      run_counts([](Counts* c) { random_division_kernel<<<1056, 256>>>(kCount, c); });
  EXPECT_EQ(counts.mismatches, 0u)
      << "first: a bits " << std::hex << counts.first_bad_a << ", b bits " << counts.first_bad_b;
  // About half of the operands fall inside the range (the rest exercise its edges).
  EXPECT_GT(counts.in_range, kCount / 4);
  EXPECT_LT(counts.in_range, kCount);
}

TEST(SwigluDivisionGpu, EveryBf16GateGivesTheSameSwigluBits) {
  for (const float limit : {std::numeric_limits<float>::infinity(), 7.0f, 0.5f}) {
    SCOPED_TRACE(testing::Message() << "limit " << limit);
    static float launch_limit;
    launch_limit = limit;
    const Counts counts =
        run_counts([](Counts* c) { every_gate_kernel<<<256, 256>>>(launch_limit, c); });
    EXPECT_EQ(counts.mismatches, 0u) << "first: gate bits " << std::hex << counts.first_bad_a
                                     << ", up bits " << counts.first_bad_b;
    // Out of range: NaNs and infinities (256 patterns), nonzero |gate| < 2^-60 (17150), gates
    // below about -41.6, where e^-gate > 2^60 (~15700), and, unclamped, gates above 2^60 (8576):
    // about 23800 of the 65536 patterns are in range without a clamp. Every value a layer meets in
    // practice (zero, or 2^-60 <= |gate| <= 32) must be.
    EXPECT_EQ(counts.practical_out_of_range, 0u);
    EXPECT_GT(counts.in_range, 23000u);
  }
}

TEST(SwigluDivisionGpu, UnitsOfBf16ValuesGiveTheBitsOfTheAccumulatorForm) {
  for (const float limit : {std::numeric_limits<float>::infinity(), 7.0f, 0.5f}) {
    SCOPED_TRACE(testing::Message() << "limit " << limit);
    static float launch_limit;
    launch_limit = limit;
    const Counts counts = run_counts([](Counts* c) { unit_kernel<<<32, 256>>>(launch_limit, c); });
    EXPECT_EQ(counts.mismatches, 0u) << "first: gate bits " << std::hex << counts.first_bad_a
                                     << ", up bits " << counts.first_bad_b;
    EXPECT_EQ(counts.in_range, 65536u);
  }
}

TEST(SwigluDivisionGpu, BackwardUnitsOfBf16ValuesGiveTheBitsOfTheAccumulatorForm) {
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
      EXPECT_EQ(counts.in_range, 3u * 65536u);
    }
  }
}

}  // namespace
}  // namespace mok
