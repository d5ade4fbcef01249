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

#include "kernels/comm/launch.h"
#include "kernels/comm/routing_exchange.cuh"
#include "kernels/common/kernel_preload.h"

namespace mok::kernels {

namespace {

__global__ void routing_exchange_kernel(RoutingExchangeArgs args) {
  exchange_with_peer(args, static_cast<int32_t>(blockIdx.x));
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
