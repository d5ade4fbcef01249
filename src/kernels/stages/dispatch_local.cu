// Local dispatch: copies each routed token's row of x into its slots of the expert-grouped row
// buffer (the single-GPU form of the pull dispatch), and zeroes padding rows so that the GEMMs
// that sum over rows (weight gradients) see zeros there. These standalone kernels serve the
// backward (d_out rows, and x rows without a forward context); the forward runs the row-order
// copy fused into its gate/up GEMM (dispatch_local.cuh), whose epoch this file also advances.
//
// Two walks, the same bytes written:
//   by token (gather_rows_by_token_kernel, the layer's): a warp per token reads the token's row
//     once and stores it into each of its top_k rows (pair_row), 8 vectors a lane in flight;
//     a warp per 32 schedule rows zeroes the padding rows among them. DRAM reads are the rows
//     of x once (34 MB at `qwen3`).
//   by row (gather_rows_kernel, the baseline's and the reference for the tests): a warp per
//     schedule row copies x[token of the row]. Each token's row is read top_k times, spread over
//     the whole pass, and mostly misses L2: at `qwen3` on an H100 it reads ~160-180 MB for 34 MB
//     of d_out (23-31% hits; streaming stores and an evict-last policy on the loads moved that
//     little), beside the 280 MB it writes, at 81% of the DRAM peak (ncu, docs/perf.md, session
//     38).
// A launch may cover one macrobatch's window of rows (kernels/macrobatch.h), stored at
// row - window start in the ring buffer; rows past header.total_rows are left alone.
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/common/overlapped_launch.h"
#include "kernels/common/ptx.cuh"
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
  ptx::begin_after_previous_kernel();
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

// A warp per token: lane k holds the row of pair (token, k) if it falls inside the window. The
// token's row is loaded 8 vectors a lane at a time and stored to each of those rows before the
// next 8 are loaded. Padding rows first: the warps' 32-row steps read row_pair and zero the rows
// it marks -1.
__global__ void __launch_bounds__(kGatherThreads, kGatherCtasPerSm)
    gather_rows_by_token_kernel(const ScheduleHeader* header, const int32_t* row_pair,
                                const int32_t* pair_row, const uint4* x, int64_t num_tokens,
                                int64_t vectors_per_row, int32_t top_k, uint4* rows,
                                int64_t row_begin, int64_t row_count) {
  constexpr int kInFlight = 8;
  ptx::begin_after_previous_kernel();
  const int64_t end = min(static_cast<int64_t>(header->total_rows), row_begin + row_count);
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int64_t warp = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  for (int64_t first = row_begin + warp * 32; first < end; first += warps_total * 32) {
    const int64_t row = first + lane;
    unsigned padding = __ballot_sync(~0u, row < end && row_pair[row] < 0);
    while (padding != 0) {
      const int offset = __ffs(padding) - 1;
      padding &= padding - 1;
      uint4* dst = rows + (first + offset - row_begin) * vectors_per_row;
      for (int64_t v = lane; v < vectors_per_row; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
    }
  }
  for (int64_t token = warp; token < num_tokens; token += warps_total) {
    int64_t my_row = -1;
    if (lane < top_k) {
      const int64_t row = pair_row[token * top_k + lane];
      if (row >= row_begin && row < end) my_row = row - row_begin;
    }
    const unsigned slots = __ballot_sync(~0u, my_row >= 0);
    if (slots == 0) continue;
    const uint4* __restrict__ src = x + token * vectors_per_row;
    // The chunk loop is warp-uniform: the shuffles below need every lane, also where a row's
    // vectors do not fill the last chunk.
    for (int64_t chunk = 0; chunk < vectors_per_row; chunk += 32 * kInFlight) {
      const int64_t base = chunk + lane;
      uint4 values[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u)
        if (base + u * 32 < vectors_per_row) values[u] = __ldg(src + base + u * 32);
      for (unsigned left = slots; left != 0; left &= left - 1) {
        const int64_t dst_row = __shfl_sync(~0u, my_row, __ffs(left) - 1);
        uint4* __restrict__ dst = rows + dst_row * vectors_per_row;
#pragma unroll
        for (int u = 0; u < kInFlight; ++u)
          if (base + u * 32 < vectors_per_row) dst[base + u * 32] = values[u];
      }
    }
  }
}

__global__ void advance_epoch_kernel(unsigned long long* epoch) {
  ptx::begin_after_previous_kernel();
  *epoch += 1;
}

// Both walks' grid: their launch bound's CTAs on every SM of the current device.
int gather_ctas() { return current_sm_count() * kGatherCtasPerSm; }

}  // namespace

cudaError_t launch_advance_epoch(unsigned long long* epoch, KernelStream on) {
  return launch_maybe_overlapped(advance_epoch_kernel, 1, 1, 0, on, 1, epoch);
}

cudaError_t launch_gather_rows(const ScheduleHeader* header, const int32_t* row_pair, const void* x,
                               int64_t hidden, int32_t top_k, void* rows, int64_t max_rows,
                               KernelStream on, int64_t row_begin) {
  if (max_rows == 0) return cudaSuccess;
  if (row_begin < 0 || max_rows < 0) return cudaErrorInvalidValue;
  return launch_maybe_overlapped(gather_rows_kernel, gather_ctas(), kGatherThreads, 0, on, 1,
                                 header, row_pair, static_cast<const uint4*>(x), hidden / 8, top_k,
                                 static_cast<uint4*>(rows), row_begin, max_rows);
}

cudaError_t launch_gather_rows_by_token(const ScheduleHeader* header, const int32_t* row_pair,
                                        const int32_t* pair_row, const void* x, int64_t num_tokens,
                                        int64_t hidden, int32_t top_k, void* rows, int64_t max_rows,
                                        KernelStream on, int64_t row_begin) {
  if (max_rows == 0) return cudaSuccess;
  if (row_begin < 0 || max_rows < 0 || num_tokens < 0 || top_k < 1 || top_k > 32 || hidden % 8 != 0)
    return cudaErrorInvalidValue;
  return launch_maybe_overlapped(gather_rows_by_token_kernel, gather_ctas(), kGatherThreads, 0, on,
                                 1, header, row_pair, pair_row, static_cast<const uint4*>(x),
                                 num_tokens, hidden / 8, top_k, static_cast<uint4*>(rows),
                                 row_begin, max_rows);
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("dispatch_local.cu", {kernel_symbol(&gather_rows_kernel),
                                                       kernel_symbol(&gather_rows_by_token_kernel),
                                                       kernel_symbol(&advance_epoch_kernel)});
}  // namespace

}  // namespace mok::kernels
