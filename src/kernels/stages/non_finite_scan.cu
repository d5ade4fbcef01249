// The input scan of MoeConfig::check_finite (non_finite_scan.h): a memory-bound pass that
// finds the first NaN or infinity of each input tensor.
//
// Roles: blockIdx.y picks the tensor; the x dimension walks it grid-stride, 16 bytes (8 bf16
// values) per thread and step. A thread stops at its first non-finite value (its later ones
// have larger indices), the warp takes the minimum of its lanes' keys, and lane 0 lowers the
// record with an integer atomicMin: the record's final value does not depend on which warp ran
// first. Router weights are read only where their slot routes to an expert.
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/stages/non_finite_scan.h"

namespace mok::kernels {

namespace {

constexpr int kScanThreads = 256;
constexpr unsigned long long kNone = kNoNonFinite;

__device__ __forceinline__ NonFiniteKind kind_of_bf16(uint32_t bits) {
  return (bits & 0x7Fu) != 0     ? NonFiniteKind::kNaN
         : (bits & 0x8000u) != 0 ? NonFiniteKind::kNegativeInf
                                 : NonFiniteKind::kPositiveInf;
}

// The key of the first non-finite value among the 8 bf16 values at element `first`, or kNone.
__device__ __forceinline__ unsigned long long first_in_vector(const uint4& vector, int64_t first,
                                                              ScannedTensor id) {
  const uint32_t words[4] = {vector.x, vector.y, vector.z, vector.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t bits = (words[w] >> (16 * half)) & 0xFFFFu;
      if ((bits & 0x7F80u) == 0x7F80u)  // exponent all ones: an infinity or a NaN
        return non_finite_key(id, first + 2 * w + half, kind_of_bf16(bits));
    }
  }
  return kNone;
}

__device__ __forceinline__ unsigned long long scan_bf16(const ScanTensor& tensor, int64_t start,
                                                        int64_t stride) {
  const uint4* vectors = static_cast<const uint4*>(tensor.data);
  const int64_t num_vectors = tensor.count / 8;
  for (int64_t v = start; v < num_vectors; v += stride) {
    const unsigned long long key = first_in_vector(__ldg(vectors + v), v * 8, tensor.id);
    if (key != kNone) return key;
  }
  return kNone;
}

__device__ __forceinline__ unsigned long long scan_router_weights(const ScanTensor& tensor,
                                                                  int64_t start, int64_t stride) {
  const float* weights = static_cast<const float*>(tensor.data);
  for (int64_t i = start; i < tensor.count; i += stride) {
    const int64_t expert = tensor.routes_are_int64 != 0
                               ? static_cast<const int64_t*>(tensor.routes)[i]
                               : static_cast<const int32_t*>(tensor.routes)[i];
    if (expert < 0 || expert >= tensor.num_experts) continue;  // not routed: never read
    const float weight = weights[i];
    if (!isfinite(weight))
      return non_finite_key(tensor.id, i,
                            isnan(weight)     ? NonFiniteKind::kNaN
                            : signbit(weight) ? NonFiniteKind::kNegativeInf
                                              : NonFiniteKind::kPositiveInf);
  }
  return kNone;
}

__global__ void __launch_bounds__(kScanThreads)
    non_finite_scan_kernel(NonFiniteScan scan, unsigned long long* record) {
  const ScanTensor& tensor = scan.tensors[blockIdx.y];
  const int64_t start = blockIdx.x * static_cast<int64_t>(kScanThreads) + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kScanThreads;
  unsigned long long key = tensor.id == ScannedTensor::kRouterWeights
                               ? scan_router_weights(tensor, start, stride)
                               : scan_bf16(tensor, start, stride);
  if (!__any_sync(0xffffffffu, key != kNone)) return;
  for (int offset = 16; offset > 0; offset /= 2) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, key, offset);
    key = other < key ? other : key;
  }
  if (threadIdx.x % 32 == 0) atomicMin(record, key);
}

}  // namespace

cudaError_t launch_non_finite_scan(const NonFiniteScan& scan, unsigned long long* record,
                                   int sm_count, cudaStream_t stream) {
  if (scan.num_tensors <= 0) return cudaSuccess;
  int64_t largest = 0;
  for (int i = 0; i < scan.num_tensors; ++i)
    largest = scan.tensors[i].count > largest ? scan.tensors[i].count : largest;
  // Enough 8-value vectors per block for the largest tensor, at most a few waves of the GPU.
  const int64_t wanted = (largest / 8 + kScanThreads - 1) / kScanThreads;
  const int64_t most = static_cast<int64_t>(sm_count) * 8;
  const int blocks = static_cast<int>(wanted < 1 ? 1 : wanted < most ? wanted : most);
  non_finite_scan_kernel<<<dim3(blocks, scan.num_tensors), kScanThreads, 0, stream>>>(scan, record);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("non_finite_scan.cu", {kernel_symbol(&non_finite_scan_kernel)});
}  // namespace

}  // namespace mok::kernels
