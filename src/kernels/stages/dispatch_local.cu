// Local dispatch: copies each routed token's row of x into its slot of the expert-grouped row
// buffer (the single-GPU form of the pull dispatch), and zeroes padding rows so that the GEMMs
// that sum over rows (weight gradients) see zeros there. This standalone kernel serves the
// backward (d_out rows, and x rows without a forward context); the forward runs the same copy
// fused into its gate/up GEMM (dispatch_local.cuh), whose epoch this file also advances.
//
// Roles: a grid-stride loop; each warp copies one row at a time (copy_row of dispatch_local.cuh,
// 8 vectors a lane in flight). Rows past header.total_rows are left alone. A launch may cover
// one macrobatch's window of rows (kernels/macrobatch.h), stored at row - window start in the
// ring buffer.
// What bounds it is DRAM: at `qwen3` on an H100 it writes 280 MB and, with the source rows
// mostly missing L2 (23-31% hits; streaming stores and an evict-last policy on the loads moved
// that little), reads ~160-180 MB, at 81% of the DRAM peak (ncu, docs/perf.md, session 38).
// Eight vectors in flight instead of one took 2-3% off; the copy's cost goes only with the copy
// itself, and the GEMMs reading the rows in place instead measured slower (docs/perf.md, session
// 39).
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/stages/dispatch_local.cuh"
#include "kernels/stages/launch.h"

namespace mok::kernels {

namespace {

constexpr int kGatherThreads = 256;
// Four CTAs an SM give ptxas 64 registers: with no minimum it kept 32 and interleaved the loads
// with the stores, two in flight. 64 registers also cap the SM at those four CTAs.
constexpr int kGatherCtasPerSm = 4;

__global__ void __launch_bounds__(kGatherThreads, kGatherCtasPerSm)
    gather_rows_kernel(const ScheduleHeader* header, const int32_t* row_pair, const uint4* x,
                       int64_t vectors_per_row, int32_t top_k, uint4* rows, int64_t row_begin,
                       int64_t row_count) {
  const int64_t end = min(static_cast<int64_t>(header->total_rows), row_begin + row_count);
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t row = row_begin + (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
       row < end; row += warps_total) {
    const int pair = row_pair[row];
    copy_row<8>(pair < 0 ? nullptr : x + static_cast<int64_t>(pair / top_k) * vectors_per_row,
                rows + (row - row_begin) * vectors_per_row, vectors_per_row, lane, true);
  }
}

__global__ void advance_epoch_kernel(unsigned long long* epoch) { *epoch += 1; }

}  // namespace

cudaError_t launch_advance_epoch(unsigned long long* epoch, cudaStream_t stream) {
  advance_epoch_kernel<<<1, 1, 0, stream>>>(epoch);
  return cudaGetLastError();
}

cudaError_t launch_gather_rows(const ScheduleHeader* header, const int32_t* row_pair, const void* x,
                               int64_t hidden, int32_t top_k, void* rows, int64_t max_rows,
                               cudaStream_t stream, int64_t row_begin) {
  if (max_rows == 0) return cudaSuccess;
  if (row_begin < 0 || max_rows < 0) return cudaErrorInvalidValue;
  int device = 0, sm_count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device);
  gather_rows_kernel<<<sm_count * kGatherCtasPerSm, kGatherThreads, 0, stream>>>(
      header, row_pair, static_cast<const uint4*>(x), hidden / 8, top_k, static_cast<uint4*>(rows),
      row_begin, max_rows);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("dispatch_local.cu", {kernel_symbol(&gather_rows_kernel),
                                                       kernel_symbol(&advance_epoch_kernel)});
}  // namespace

}  // namespace mok::kernels
