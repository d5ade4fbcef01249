// One warp copies one row of 16-byte vectors, kLoadsInFlight independent loads per lane before
// their stores (a warp's memory-level parallelism sets the speed of row copies, more so across
// NVLink, whose latency is ~1-2 us). Source and destination may be local or a peer's memory.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace mok::kernels {

// Loads in flight per lane for row copies that cross NVLink. A pull reads across the link
// (~2 us a round trip) and a push stores there but reads its rows from local memory first, each
// batch of loads waiting for the last: with 4 per lane a 14 KB row took 7 dependent batches, and
// the pull reached 184 GB/s per GPU with 24 CTAs on 2 x H200; 16 per lane gave the pull 232
// (docs/perf.md). 16 uint4 are 64 registers, no spill at 256 threads.
constexpr int kNvlinkLoadsInFlight = 16;

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
