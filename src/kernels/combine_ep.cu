// Push combine across GPUs (DESIGN.md §2.4): each expert output row goes straight into its
// source rank's symmetric slot buffer [T*K, H] at slot token*K + k, over NVLink; a pair is
// routed to one expert, so every slot has one writer. The source rank then sums its slots in
// fixed order (launch_combine, whose row index comes from launch_slot_index). Backward: the dx
// rows go back the same way (the reverse of the pull dispatch).
//
// Roles of the push: a grid-stride loop over the schedule's rows, one warp per row
// (copy_row_warp, 16-byte stores to the peer); with RowCopy::kBulk the launch moves
// them with the bulk-copy engine, one thread per CTA (bulk_rows.cuh). Completion: after its rows,
// each CTA fences at system scope and counts itself done on a local counter (epoch *
// kPushDoneStride + CTAs done); the last CTA of the launch signals every rank (peer_barrier.cuh).
// The source side runs launch_wait_for_peers before it reads its slots.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/bulk_rows.cuh"
#include "kernels/kernel_preload.h"
#include "kernels/launchers.h"
#include "kernels/peer_barrier.cuh"
#include "kernels/row_copy.cuh"

namespace mok::kernels {

namespace {

constexpr unsigned long long kPushDoneStride = 1ull << 24;  // > CTAs of one launch

// The last CTA of a push launch to count itself done signals every rank (all rows stored).
__device__ __forceinline__ void count_push_done(const PushRowsArgs& args, uint64_t epoch) {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  atomicMax(args.done, epoch * kPushDoneStride);
  const unsigned long long before = atomicAdd(args.done, 1ull);
  if (before - epoch * kPushDoneStride == gridDim.x - 1)
    for (int32_t peer = 0; peer < args.num_ranks; ++peer)
      signal_peer(args.flag_peers[peer], args.rank, epoch);
}

__global__ void push_rows_kernel(PushRowsArgs args) {
  const uint64_t epoch = *reinterpret_cast<const volatile unsigned long long*>(args.epoch) + 1;
  const int32_t total_rows = args.header->total_rows;
  const int warps_total = gridDim.x * blockDim.x / 32;
  for (int32_t row = (blockIdx.x * blockDim.x + threadIdx.x) / 32; row < total_rows;
       row += warps_total) {
    const int32_t pair = args.row_pair[row];
    if (pair < 0) continue;
    const int32_t source_rank = pair / args.pairs_per_rank, slot = pair % args.pairs_per_rank;
    uint4* dst = static_cast<uint4*>(args.slot_peers[source_rank]) +
                 static_cast<int64_t>(slot) * args.vectors_per_row;
    copy_row_warp<kNvlinkLoadsInFlight>(
        dst,
        static_cast<const uint4*>(args.rows) + static_cast<int64_t>(row) * args.vectors_per_row,
        args.vectors_per_row);
  }
  __syncthreads();
  if (threadIdx.x == 0) count_push_done(args, epoch);
}

// The bulk-copy variant: one thread per CTA streams its rows (rows blockIdx.x + i * gridDim.x
// with a pair) through shared memory into the source ranks' slots (bulk_rows.cuh).
__global__ void push_rows_bulk_kernel(PushRowsArgs args, WaitContext wait) {
  if (threadIdx.x != 0) return;
  extern __shared__ __align__(16) char smem[];
  const uint64_t epoch = *reinterpret_cast<const volatile unsigned long long*>(args.epoch) + 1;
  const int32_t total_rows = args.header->total_rows;
  const uint32_t row_bytes = static_cast<uint32_t>(args.vectors_per_row * 16);
  int64_t row = blockIdx.x;  // the next candidate row of this CTA
  move_rows_bulk(wait, smem, row_bytes, [&](int64_t, const void** source, void** destination) {
    for (; row < total_rows; row += gridDim.x) {
      const int32_t pair = args.row_pair[row];
      if (pair < 0) continue;
      const int32_t source_rank = pair / args.pairs_per_rank, slot = pair % args.pairs_per_rank;
      *source = static_cast<const char*>(args.rows) + row * row_bytes;
      *destination =
          static_cast<char*>(args.slot_peers[source_rank]) + static_cast<int64_t>(slot) * row_bytes;
      row += gridDim.x;
      return true;
    }
    return false;
  });
  count_push_done(args, epoch);
}

__global__ void wait_for_peers_kernel(const uint64_t* own_flags, int32_t num_ranks,
                                      const unsigned long long* epoch_word, WaitContext wait) {
  const uint64_t epoch = *reinterpret_cast<const volatile unsigned long long*>(epoch_word) + 1;
  const int32_t peer = static_cast<int32_t>(threadIdx.x);
  if (peer < num_ranks) wait_for_peer(wait, own_flags, peer, epoch);
}

template <typename ExpertId>
__global__ void slot_index_kernel(const ExpertId* top_experts, int64_t count, int64_t num_experts,
                                  int32_t* slot_index) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t expert = static_cast<int64_t>(top_experts[i]);
    slot_index[i] = expert >= 0 && expert < num_experts ? static_cast<int32_t>(i) : -1;
  }
}

}  // namespace

cudaError_t launch_push_rows(const PushRowsArgs& args, RowCopy copy, int num_ctas,
                             const WaitContext& wait, cudaStream_t stream) {
  if (num_ctas < 1 || static_cast<unsigned long long>(num_ctas) >= kPushDoneStride ||
      args.num_ranks < 1 || args.pairs_per_rank < 0)
    return cudaErrorInvalidValue;
  if (copy == RowCopy::kBulk)
    return launch_bulk_rows(push_rows_bulk_kernel, args, wait, args.vectors_per_row * 16, num_ctas,
                            stream);
  push_rows_kernel<<<num_ctas, 256, 0, stream>>>(args);
  return cudaGetLastError();
}

cudaError_t launch_wait_for_peers(const uint64_t* own_flags, int32_t num_ranks,
                                  const unsigned long long* epoch, const WaitContext& wait,
                                  cudaStream_t stream) {
  if (num_ranks < 1 || num_ranks > 1024) return cudaErrorInvalidValue;
  wait_for_peers_kernel<<<1, 32 * ((num_ranks + 31) / 32), 0, stream>>>(own_flags, num_ranks, epoch,
                                                                        wait);
  return cudaGetLastError();
}

cudaError_t launch_slot_index(const void* top_experts, DType expert_dtype, int64_t count,
                              int64_t num_experts, int32_t* slot_index, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, 1024));
  if (expert_dtype == DType::kInt64)
    slot_index_kernel<<<blocks, 256, 0, stream>>>(static_cast<const int64_t*>(top_experts), count,
                                                  num_experts, slot_index);
  else
    slot_index_kernel<<<blocks, 256, 0, stream>>>(static_cast<const int32_t*>(top_experts), count,
                                                  num_experts, slot_index);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("combine_ep.cu", {kernel_symbol(&push_rows_kernel),
                                                   kernel_symbol(&push_rows_bulk_kernel),
                                                   kernel_symbol(&wait_for_peers_kernel),
                                                   kernel_symbol(&slot_index_kernel<int32_t>),
                                                   kernel_symbol(&slot_index_kernel<int64_t>)});
}  // namespace

}  // namespace mok::kernels
