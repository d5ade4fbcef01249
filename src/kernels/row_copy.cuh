// One warp copies one row of 16-byte vectors, kLoadsInFlight independent loads per lane before
// their stores (a warp's memory-level parallelism sets the speed of row copies, more so across
// NVLink, whose latency is ~1-2 us). Source and destination may be local or a peer's memory.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace mok::kernels {

template <int kLoadsInFlight = 4>
__device__ __forceinline__ void copy_row_warp(uint4* dst, const uint4* src, int64_t vectors) {
  const int lane = threadIdx.x % 32;
  for (int64_t base = lane; base < vectors; base += 32 * kLoadsInFlight) {
    uint4 values[kLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u)
      if (base + u * 32 < vectors) values[u] = src[base + u * 32];
#pragma unroll
    for (int u = 0; u < kLoadsInFlight; ++u)
      if (base + u * 32 < vectors) dst[base + u * 32] = values[u];
  }
}

}  // namespace mok::kernels
