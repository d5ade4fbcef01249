// The on-GPU all-gather of the routing (DESIGN.md §2.1, first step of the multi-GPU forward):
// every rank's top_experts [T, K] lands in every rank's routing_all [R, T, K] (symmetric
// memory) at block `rank`, with no host synchronization, so each rank can build its schedule
// from all ranks' routing.
//
// Grid: one CTA per peer p (p = blockIdx.x, including this rank itself). CTA p copies this
// rank's block into p's routing_all through the peer pointer (16-byte accesses when aligned,
// else 4-byte), then its thread 0 signals p (peer_barrier.cuh: system-scope release of the
// epoch into p's flags[rank]) and waits for p's signal to this rank. When the kernel ends,
// every rank's block is in this rank's routing_all. A rank that never arrives ends the wait in
// a diagnosed timeout; the diagnosis's block is the missing peer. Optionally the router weights
// travel the same way (the expert side of the backward scales by them); with no payload the
// kernel is a plain barrier of the group.
#include <cuda_runtime_api.h>

#include "kernels/kernel_preload.h"
#include "kernels/launchers.h"
#include "kernels/peer_barrier.cuh"

namespace mok::kernels {

namespace {

// This CTA's share of copying `bytes` from `source` to `destination` (both 4-byte aligned).
__device__ __forceinline__ void copy_block(char* destination, const char* source, int64_t bytes) {
  const bool vectorized = bytes % 16 == 0 && reinterpret_cast<uintptr_t>(source) % 16 == 0 &&
                          reinterpret_cast<uintptr_t>(destination) % 16 == 0;
  if (vectorized) {
    for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x)
      reinterpret_cast<uint4*>(destination)[i] = reinterpret_cast<const uint4*>(source)[i];
  } else {
    for (int64_t i = threadIdx.x; i < bytes / 4; i += blockDim.x)
      reinterpret_cast<uint32_t*>(destination)[i] = reinterpret_cast<const uint32_t*>(source)[i];
  }
}

__global__ void routing_exchange_kernel(RoutingExchangeArgs args) {
  const int32_t peer = static_cast<int32_t>(blockIdx.x);
  const uint64_t epoch = *reinterpret_cast<const volatile unsigned long long*>(args.epoch) + 1;
  if (args.bytes_per_rank > 0)
    copy_block(static_cast<char*>(args.routing_peers[peer]) + args.rank * args.bytes_per_rank,
               static_cast<const char*>(args.top_experts), args.bytes_per_rank);
  if (args.weight_bytes_per_rank > 0)
    copy_block(static_cast<char*>(args.weight_peers[peer]) + args.rank * args.weight_bytes_per_rank,
               reinterpret_cast<const char*>(args.weights), args.weight_bytes_per_rank);
  __syncthreads();
  if (threadIdx.x == 0) {
    signal_peer(args.flag_peers[peer], args.rank, epoch);
    wait_for_peer(args.wait, args.flag_peers[args.rank], peer, epoch);
  }
}

}  // namespace

cudaError_t launch_routing_exchange(const RoutingExchangeArgs& args, cudaStream_t stream) {
  if (args.num_ranks < 1 || args.bytes_per_rank % 4 != 0 || args.weight_bytes_per_rank % 4 != 0)
    return cudaErrorInvalidValue;
  routing_exchange_kernel<<<args.num_ranks, 256, 0, stream>>>(args);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("routing_exchange.cu", {kernel_symbol(&routing_exchange_kernel)});
}  // namespace

}  // namespace mok::kernels
