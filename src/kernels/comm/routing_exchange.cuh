// The routing all-gather as a device function (routing_exchange.cu has the map): a CTA's share
// of one peer's exchange, for the standalone kernel (one CTA per peer) and for a persistent
// kernel's communication CTAs.
#pragma once

#include <stdint.h>

#include "kernels/comm/launch.h"
#include "kernels/comm/peer_barrier.cuh"

namespace mok::kernels {

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

// Called by every thread of one CTA: copies this rank's routing (and router weights) into
// `peer`'s gathered arrays, then thread 0 signals `peer` and waits for `peer`'s signal. When
// the CTAs of every peer returned, every rank's block is in this rank's gathered arrays.
__device__ __forceinline__ void exchange_with_peer(const RoutingExchangeArgs& args, int32_t peer) {
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

}  // namespace mok::kernels
