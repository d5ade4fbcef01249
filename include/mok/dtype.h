// Element types of mok tensors, and the bf16 rounding used by the CPU reference.
//
// The bf16 conversion here rounds to nearest even and maps every NaN to 0x7FFF, which is what
// CUDA's __float2bfloat16_rn does, so the CPU reference and the GPU kernels round identically.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOK_HOST_DEVICE __host__ __device__
#else
#define MOK_HOST_DEVICE
#endif

namespace mok {

enum class DType : int32_t {
  kBFloat16 = 0,
  kFloat32 = 1,
  kInt32 = 2,
  kInt64 = 3,
  kFloat8E4M3 = 4,  // reserved for the FP8 path
};

MOK_HOST_DEVICE constexpr int64_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
      return 4;
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
    case DType::kFloat8E4M3:
      return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype);

// A bf16 value as its 16 bits. Host-side storage type of the CPU reference; device code uses
// __nv_bfloat16, which has the same layout.
struct bf16 {
  uint16_t bits = 0;
};
static_assert(sizeof(bf16) == 2, "bf16 must be 2 bytes");

MOK_HOST_DEVICE inline float bf16_to_float(bf16 value) {
  uint32_t word = static_cast<uint32_t>(value.bits) << 16;
  float out;
  memcpy(&out, &word, sizeof(out));
  return out;
}

MOK_HOST_DEVICE inline bf16 float_to_bf16(float value) {
  uint32_t word;
  memcpy(&word, &value, sizeof(word));
  bf16 out;
  if ((word & 0x7fffffffu) > 0x7f800000u) {
    out.bits = 0x7fff;  // NaN, as CUDA's __float2bfloat16_rn
  } else {
    word += 0x7fffu + ((word >> 16) & 1u);  // round to nearest, ties to even
    out.bits = static_cast<uint16_t>(word >> 16);
  }
  return out;
}

// Rounds a float to the nearest bf16 and returns it as a float.
MOK_HOST_DEVICE inline float round_to_bf16(float value) {
  return bf16_to_float(float_to_bf16(value));
}

}  // namespace mok
