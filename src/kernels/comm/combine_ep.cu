// Push combine across GPUs (DESIGN.md §2.4): each expert output row of another rank's pair goes
// straight into its source rank's symmetric slot buffer [T*K, H] at slot token*K + k, over
// NVLink; a pair is routed to one expert, so every slot has one writer. Rows of this rank's own
// pairs are not copied: the combine reads them where the expert GEMM left them (at R = 2 that
// is half the rows, which a copy would move through HBM twice and take the copying warps from
// the link). The source rank then sums in fixed order (launch_combine, whose row index comes
// from launch_slot_index). Backward: the dx rows go back the same way (the reverse of the pull
// dispatch).
//
// Roles of the push: the whole grid runs the device functions of combine_ep.cuh (which a
// persistent kernel calls from its communication warps): one warp per row (16-byte stores to the
// peer, 16 loads in flight per lane), or with RowCopy::kBulk one thread per CTA with the
// bulk-copy engine (bulk_rows.cuh). Completion: after its rows, each CTA fences at system scope
// and counts itself done on a local counter (epoch * kDoneStride + CTAs done); the last CTA
// of the launch signals every rank (peer_barrier.cuh). The source side runs
// launch_wait_for_peers before it reads its slots.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/comm/bulk_rows.cuh"
#include "kernels/comm/combine_ep.cuh"
#include "kernels/comm/launch.h"
#include "kernels/comm/peer_barrier.cuh"
#include "kernels/comm/row_copy.cuh"
#include "kernels/common/kernel_preload.h"

namespace mok::kernels {

namespace {

__global__ void __launch_bounds__(kMaxNvlinkCopyThreads) push_rows_kernel(PushRowsArgs args) {
  const uint64_t epoch = push_epoch(args.epoch);
  if (!args.signal_only)
    push_rows_warp(args, (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32,
                   gridDim.x * static_cast<int64_t>(blockDim.x) / 32);
  __syncthreads();
  if (threadIdx.x == 0) count_push_done(args, epoch, gridDim.x);
}

__global__ void push_rows_bulk_kernel(PushRowsArgs args, WaitContext wait) {
  if (threadIdx.x != 0) return;
  extern __shared__ __align__(16) char smem[];
  const uint64_t epoch = push_epoch(args.epoch);
  if (!args.signal_only) push_rows_bulk_cta(args, wait, smem, blockIdx.x, gridDim.x);
  count_push_done(args, epoch, gridDim.x);
}

__global__ void wait_for_peers_kernel(const uint64_t* own_flags, int32_t num_ranks,
                                      const unsigned long long* epoch_word, WaitContext wait) {
  wait_for_all_pushes(wait, own_flags, num_ranks, static_cast<int32_t>(threadIdx.x),
                      push_epoch(epoch_word));
}

template <typename ExpertId>
__global__ void slot_index_kernel(const ExpertId* top_experts, int64_t count, int64_t num_experts,
                                  const int32_t* own_pair_row, int32_t* slot_index) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t expert = static_cast<int64_t>(top_experts[i]);
    const int32_t own_row = own_pair_row[i];
    slot_index[i] = own_row >= 0                          ? -2 - own_row
                    : expert >= 0 && expert < num_experts ? static_cast<int32_t>(i)
                                                          : -1;
  }
}

}  // namespace

cudaError_t launch_push_rows(const PushRowsArgs& args, RowCopy copy, int num_ctas,
                             const WaitContext& wait, cudaStream_t stream, int threads_per_cta) {
  if (num_ctas < 1 || static_cast<unsigned long long>(num_ctas) >= kDoneStride ||
      args.num_ranks < 1 || args.pairs_per_rank < 0 ||
      (copy == RowCopy::kWarp && !valid_copy_threads(threads_per_cta)))
    return cudaErrorInvalidValue;
  if (copy == RowCopy::kBulk)
    return launch_bulk_rows(push_rows_bulk_kernel, args, wait, args.vectors_per_row * 16, num_ctas,
                            stream);
  push_rows_kernel<<<num_ctas, threads_per_cta, 0, stream>>>(args);
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
                              int64_t num_experts, const int32_t* own_pair_row, int32_t* slot_index,
                              cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const int blocks = static_cast<int>(std::min<int64_t>((count + 255) / 256, 1024));
  if (expert_dtype == DType::kInt64)
    slot_index_kernel<<<blocks, 256, 0, stream>>>(static_cast<const int64_t*>(top_experts), count,
                                                  num_experts, own_pair_row, slot_index);
  else
    slot_index_kernel<<<blocks, 256, 0, stream>>>(static_cast<const int32_t*>(top_experts), count,
                                                  num_experts, own_pair_row, slot_index);
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
