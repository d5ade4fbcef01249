// The input scan of MoeConfig::check_finite: which tensors one launch reads, and the record of
// the first non-finite element it finds. Shared by the kernel (non_finite_scan.cu) and the host
// runtime that builds the scan and turns the record into a message (src/non_finite_report.cpp).
//
// The record is one 64-bit word, the minimum over every key a scan found since the host last
// read it (integer atomicMin: the same word whatever the order of the finds). A key orders by
// tensor (the ScannedTensor order), then by element index, so the record names the first
// non-finite input in that order; its two low bits say which value it was.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "mok/dtype.h"

namespace mok::kernels {

// The order in which the record ranks the inputs (a tensor earlier here wins).
enum class ScannedTensor : int32_t {
  kX = 0,
  kRouterWeights,
  kWGate,
  kWUp,
  kWDown,
  kWSharedGate,
  kWSharedUp,
  kWSharedDown,
  kDOut,
  kCount,
};

enum class NonFiniteKind : uint32_t { kNaN = 1, kPositiveInf = 2, kNegativeInf = 3 };

inline constexpr unsigned long long kNoNonFinite = ~0ull;  // the record when nothing was found
inline constexpr int kNonFiniteIndexBits = 57;             // element index: up to 2^57 - 1

MOK_HOST_DEVICE inline unsigned long long non_finite_key(ScannedTensor tensor, int64_t index,
                                                         NonFiniteKind kind) {
  return (static_cast<unsigned long long>(tensor) << (kNonFiniteIndexBits + 2)) |
         (static_cast<unsigned long long>(index) << 2) | static_cast<unsigned long long>(kind);
}
MOK_HOST_DEVICE inline ScannedTensor non_finite_tensor(unsigned long long key) {
  return static_cast<ScannedTensor>(key >> (kNonFiniteIndexBits + 2));
}
MOK_HOST_DEVICE inline int64_t non_finite_index(unsigned long long key) {
  return static_cast<int64_t>((key >> 2) & ((1ull << kNonFiniteIndexBits) - 1));
}
MOK_HOST_DEVICE inline NonFiniteKind non_finite_kind(unsigned long long key) {
  return static_cast<NonFiniteKind>(key & 3u);
}

// One tensor of a scan: `count` bf16 values (a multiple of 8, 16-byte aligned: the layer's
// validation guarantees both), or fp32 router weights, of which only the slots whose expert id
// in `routes` (int32 or int64) lies in [0, num_experts) are read: the layer ignores the others.
struct ScanTensor {
  const void* data = nullptr;
  int64_t count = 0;
  ScannedTensor id = ScannedTensor::kX;
  const void* routes = nullptr;  // router weights only
  int32_t routes_are_int64 = 0;
  int32_t num_experts = 0;
};

inline constexpr int kMaxScanTensors = static_cast<int>(ScannedTensor::kCount);

struct NonFiniteScan {
  ScanTensor tensors[kMaxScanTensors];
  int32_t num_tensors = 0;
};

// Scans every tensor of `scan` on `stream` (one launch; nothing if it holds none) and lowers
// `*record` to the key of the first non-finite element found (non_finite_scan.cu).
cudaError_t launch_non_finite_scan(const NonFiniteScan& scan, unsigned long long* record,
                                   int sm_count, cudaStream_t stream);

}  // namespace mok::kernels
