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
// Only other ranks' rows are copied; expand_received_kernel (one warp per schedule row) fills a
// macrobatch's rows from the received rows and, for this rank's own entries, from its own x or
// d_out directly.
//
// Push dispatch (measured beside the pull by `mok comm-bench`): send_entries_kernel, one CTA per
// destination, computes where each of this rank's tokens lands in the destination's receive
// list (a block reduction over the earlier ranks' tokens, then a block scan over this rank's);
// push_dispatch_kernel writes each (token, destination) row there, one warp per item, and its
// last CTA signals every rank (peer_barrier.cuh count_done_and_signal). Reads are local and the
// NVLink traffic is stores, which measured faster than loads across the link. The receive
// buffer must then be symmetric, and the caller must know every destination finished reading the
// previous call's rows before pushing (the routing exchange of the call is that barrier).
#include <cuda_bf16.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels/comm/bulk_rows.cuh"
#include "kernels/comm/dispatch_ep.cuh"
#include "kernels/comm/launch.h"
#include "kernels/comm/peer_barrier.cuh"
#include "kernels/comm/row_copy.cuh"
#include "kernels/common/kernel_preload.h"
#include "kernels/common/kernel_stream.h"

namespace mok::kernels {

namespace {

// One CTA per destination scans the earlier ranks' tokens: at R = 8 that is 7 T tokens, so a wide
// CTA.
constexpr int kSendEntriesThreads = 1024;

__global__ void __launch_bounds__(kMaxNvlinkCopyThreads) pull_rows_kernel(PullRowsArgs args) {
  pull_rows_warp(args, (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32,
                 gridDim.x * static_cast<int64_t>(blockDim.x) / 32);
}

__global__ void pull_rows_bulk_kernel(PullRowsArgs args, WaitContext wait) {
  if (threadIdx.x != 0) return;
  extern __shared__ __align__(16) char smem[];
  pull_rows_bulk_cta(args, wait, smem, blockIdx.x, gridDim.x);
}

__global__ void expand_received_kernel(ExpandReceivedArgs args) {
  const int64_t end =
      min(static_cast<int64_t>(args.header->total_rows), args.row_begin + args.row_count);
  const int32_t own_begin = args.recv_offsets[args.rank];
  const int32_t own_end = args.recv_offsets[args.rank + 1];
  const int64_t warps_total = static_cast<int64_t>(gridDim.x) * blockDim.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t vectors = args.vectors_per_row;
  for (int64_t row =
           args.row_begin + (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
       row < end; row += warps_total) {
    const int32_t entry = args.row_recv[row];
    uint4* dst = static_cast<uint4*>(args.rows) + (row - args.row_begin) * vectors;
    if (entry < 0) {
      for (int64_t v = lane; v < vectors; v += 32) dst[v] = make_uint4(0, 0, 0, 0);
      continue;
    }
    const uint4* src =
        entry >= own_begin && entry < own_end
            ? static_cast<const uint4*>(args.local_source) +
                  static_cast<int64_t>(args.recv_tokens[entry]) * vectors
            : static_cast<const uint4*>(args.received) + static_cast<int64_t>(entry) * vectors;
    for (int64_t v = lane; v < vectors; v += 32) dst[v] = __ldg(src + v);
  }
}

// One CTA per destination rank d: the tokens of ranks before this one routed to d (a block
// reduction), then this rank's tokens in order with a block scan, so entry = that count + the
// routed tokens before t (build_send_entries_host's contract, the receive list's order).
template <typename ExpertId>
__global__ void __launch_bounds__(kSendEntriesThreads)
    send_entries_kernel(ScheduleParams params, const ExpertId* routing, int32_t* send_entry) {
  using Scan = cub::BlockScan<int32_t, kSendEntriesThreads>;
  using Reduce = cub::BlockReduce<int32_t, kSendEntriesThreads>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Reduce::TempStorage reduce;
  } temp;
  __shared__ int32_t routed_before;
  const int32_t destination = static_cast<int32_t>(blockIdx.x);
  const int64_t local_experts = params.num_local_experts();
  auto routes_here = [&](int64_t global_token) -> int32_t {
    for (int32_t k = 0; k < params.top_k; ++k) {
      const int64_t expert = static_cast<int64_t>(routing[global_token * params.top_k + k]);
      if (expert >= 0 && expert < params.num_experts && expert / local_experts == destination)
        return 1;
    }
    return 0;
  };
  const int64_t first_token = static_cast<int64_t>(params.local_rank) * params.tokens_per_rank;
  int32_t count = 0;
  for (int64_t token = threadIdx.x; token < first_token; token += blockDim.x)
    count += routes_here(token);
  const int32_t total_before = Reduce(temp.reduce).Sum(count);
  if (threadIdx.x == 0) routed_before = total_before;
  __syncthreads();
  int32_t next_entry = routed_before;
  for (int32_t chunk = 0; chunk < params.tokens_per_rank; chunk += blockDim.x) {
    const int32_t token = chunk + static_cast<int32_t>(threadIdx.x);
    const int32_t routed = token < params.tokens_per_rank ? routes_here(first_token + token) : 0;
    int32_t before = 0, chunk_routed = 0;
    Scan(temp.scan).ExclusiveSum(routed, before, chunk_routed);
    if (token < params.tokens_per_rank)
      send_entry[static_cast<int64_t>(destination) * params.tokens_per_rank + token] =
          routed ? next_entry + before : -1;
    next_entry += chunk_routed;
    __syncthreads();  // the scan's storage is reused by the next chunk
  }
}

__global__ void __launch_bounds__(kMaxNvlinkCopyThreads)
    push_dispatch_kernel(PushDispatchArgs args) {
  const uint64_t epoch = *reinterpret_cast<const volatile unsigned long long*>(args.epoch) + 1;
  push_dispatch_warp(args, (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32,
                     gridDim.x * static_cast<int64_t>(blockDim.x) / 32);
  __syncthreads();
  if (threadIdx.x == 0)
    count_done_and_signal(args.done, args.flag_peers, args.rank, args.num_ranks, epoch, gridDim.x);
}

// The ceiling of a pull: one contiguous range through a peer pointer, 16-byte accesses, as many
// loads in flight per thread as the row pull (a read across NVLink waits ~1-2 us: with one load
// per thread in flight the "ceiling" measured latency, not the link).
__global__ void __launch_bounds__(kMaxNvlinkCopyThreads)
    copy_contiguous_kernel(const uint4* source, uint4* destination, int64_t vectors) {
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
                                   int num_ctas, cudaStream_t stream, int threads_per_cta) {
  if (num_ctas < 1 || bytes % 16 != 0 || !valid_copy_threads(threads_per_cta))
    return cudaErrorInvalidValue;
  if (bytes == 0) return cudaSuccess;
  copy_contiguous_kernel<<<num_ctas, threads_per_cta, 0, stream>>>(
      static_cast<const uint4*>(source), static_cast<uint4*>(destination), bytes / 16);
  return cudaGetLastError();
}

cudaError_t launch_send_entries(const ScheduleParams& params, const void* top_experts_all,
                                DType expert_dtype, int32_t* send_entry, cudaStream_t stream) {
  if (params.num_ranks < 1 || params.tokens_per_rank < 0 || params.top_k < 1 ||
      params.num_experts < params.num_ranks)
    return cudaErrorInvalidValue;
  if (params.tokens_per_rank == 0) return cudaSuccess;
  if (expert_dtype == DType::kInt64)
    send_entries_kernel<<<params.num_ranks, kSendEntriesThreads, 0, stream>>>(
        params, static_cast<const int64_t*>(top_experts_all), send_entry);
  else if (expert_dtype == DType::kInt32)
    send_entries_kernel<<<params.num_ranks, kSendEntriesThreads, 0, stream>>>(
        params, static_cast<const int32_t*>(top_experts_all), send_entry);
  else
    return cudaErrorInvalidValue;
  return cudaGetLastError();
}

cudaError_t launch_push_dispatch(const PushDispatchArgs& args, int num_ctas, cudaStream_t stream,
                                 int threads_per_cta) {
  if (num_ctas < 1 || static_cast<unsigned long long>(num_ctas) >= kDoneStride ||
      args.num_ranks < 1 || args.num_tokens < 0 || !valid_copy_threads(threads_per_cta))
    return cudaErrorInvalidValue;
  push_dispatch_kernel<<<num_ctas, threads_per_cta, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_expand_received(const ExpandReceivedArgs& args, cudaStream_t stream) {
  if (args.row_begin < 0 || args.row_count < 0 || args.rank < 0) return cudaErrorInvalidValue;
  if (args.row_count == 0) return cudaSuccess;
  const int sm_count = current_sm_count();
  expand_received_kernel<<<sm_count * 4, 256, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_pull_rows(const PullRowsArgs& args, RowCopy copy, int num_ctas,
                             const WaitContext& wait, cudaStream_t stream, int threads_per_cta) {
  if (num_ctas < 1 || args.num_ranks < 1 ||
      (copy == RowCopy::kWarp && !valid_copy_threads(threads_per_cta)))
    return cudaErrorInvalidValue;
  if (copy == RowCopy::kBulk)
    return launch_bulk_rows(pull_rows_bulk_kernel, args, wait, args.vectors_per_row * 16, num_ctas,
                            stream);
  pull_rows_kernel<<<num_ctas, threads_per_cta, 0, stream>>>(args);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("dispatch_ep.cu", {kernel_symbol(&pull_rows_kernel),
                                                    kernel_symbol(&pull_rows_bulk_kernel),
                                                    kernel_symbol(&copy_contiguous_kernel),
                                                    kernel_symbol(&expand_received_kernel),
                                                    kernel_symbol(&send_entries_kernel<int32_t>),
                                                    kernel_symbol(&send_entries_kernel<int64_t>),
                                                    kernel_symbol(&push_dispatch_kernel)});
}  // namespace

}  // namespace mok::kernels
