// Pull dispatch across GPUs (DESIGN.md §2.2): the expert-owning rank reads the rows its experts
// need straight out of the peers' symmetric buffers over NVLink, one row per (source rank,
// token) of the schedule's receive list, so a token routed to several experts of this rank
// crosses NVLink once; launch_gather_rows then expands the received rows into the
// expert-grouped row buffer (its index is the schedule's row_recv, divisor 1). Forward: x rows;
// backward: d_out rows (the reverse of the combine).
//
// Roles: the whole grid runs the device functions of dispatch_ep.cuh (which a persistent kernel
// calls from its communication warps): one warp per receive entry with 16-byte loads from the
// peer, 16 in flight per lane, or with RowCopy::kBulk one thread per CTA streaming rows with the
// bulk-copy engine (bulk_rows.cuh). `mok comm-bench` measured the warp copies faster.
// Ordering: the caller's routing exchange (routing_exchange.cu) ran first on this stream, and
// every rank publishes its source buffer before signaling it, so the rows are there to read.
#include <cuda_bf16.h>

#include "kernels/bulk_rows.cuh"
#include "kernels/dispatch_ep.cuh"
#include "kernels/kernel_preload.h"
#include "kernels/launchers.h"
#include "kernels/row_copy.cuh"

namespace mok::kernels {

namespace {

__global__ void pull_rows_kernel(PullRowsArgs args) {
  pull_rows_warp(args, (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32,
                 gridDim.x * static_cast<int64_t>(blockDim.x) / 32);
}

__global__ void pull_rows_bulk_kernel(PullRowsArgs args, WaitContext wait) {
  if (threadIdx.x != 0) return;
  extern __shared__ __align__(16) char smem[];
  pull_rows_bulk_cta(args, wait, smem, blockIdx.x, gridDim.x);
}

// The ceiling of a pull: one contiguous range through a peer pointer, 16-byte accesses, as many
// loads in flight per thread as the row pull (a read across NVLink waits ~1-2 us: with one load
// per thread in flight the "ceiling" measured latency, not the link).
__global__ void copy_contiguous_kernel(const uint4* source, uint4* destination, int64_t vectors) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t base = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; base < vectors;
       base += stride * kNvlinkLoadsInFlight) {
    uint4 values[kNvlinkLoadsInFlight];
#pragma unroll
    for (int u = 0; u < kNvlinkLoadsInFlight; ++u)
      if (base + u * stride < vectors) values[u] = source[base + u * stride];
#pragma unroll
    for (int u = 0; u < kNvlinkLoadsInFlight; ++u)
      if (base + u * stride < vectors) destination[base + u * stride] = values[u];
  }
}

}  // namespace

cudaError_t launch_copy_contiguous(const void* source, void* destination, int64_t bytes,
                                   int num_ctas, cudaStream_t stream) {
  if (num_ctas < 1 || bytes % 16 != 0) return cudaErrorInvalidValue;
  if (bytes == 0) return cudaSuccess;
  copy_contiguous_kernel<<<num_ctas, 256, 0, stream>>>(
      static_cast<const uint4*>(source), static_cast<uint4*>(destination), bytes / 16);
  return cudaGetLastError();
}

cudaError_t launch_pull_rows(const PullRowsArgs& args, RowCopy copy, int num_ctas,
                             const WaitContext& wait, cudaStream_t stream) {
  if (num_ctas < 1 || args.num_ranks < 1) return cudaErrorInvalidValue;
  if (copy == RowCopy::kBulk)
    return launch_bulk_rows(pull_rows_bulk_kernel, args, wait, args.vectors_per_row * 16, num_ctas,
                            stream);
  pull_rows_kernel<<<num_ctas, 256, 0, stream>>>(args);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("dispatch_ep.cu", {kernel_symbol(&pull_rows_kernel),
                                                    kernel_symbol(&pull_rows_bulk_kernel),
                                                    kernel_symbol(&copy_contiguous_kernel)});
}  // namespace

}  // namespace mok::kernels
