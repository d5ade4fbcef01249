// Cross-GPU signals without NVLink multicast (DESIGN.md §2.8): unicast flags with epochs in
// symmetric memory. Rank s tells rank d "everything I wrote to you before this is visible" by
// a system-scope release store of the epoch into d's flags[s]; d waits with system-scope
// acquire loads of its own flags[s] until they reach the epoch, through wait_until (a missing
// peer ends in a diagnosed timeout, not a hang). Flags only grow (epochs), so nothing is reset
// and CUDA-graph replays work; a flag array is [num_ranks] uint64 per rank.
#pragma once

#include <stdint.h>

#include "kernels/common/wait.cuh"

namespace mok::kernels {

// Rank `rank`'s signal to the rank owning `peer_flags` (that rank's flag array, as this GPU
// addresses it). The caller made its own writes to the peer visible first (this thread's
// writes, or the CTA's after __syncthreads: the fence below is cumulative).
__device__ __forceinline__ void signal_peer(uint64_t* peer_flags, int32_t rank, uint64_t epoch) {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(peer_flags + rank), "l"(epoch)
               : "memory");
}

__device__ __forceinline__ uint64_t load_flag(const uint64_t* flag) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  return value;
}

// Waits until rank `peer` has signaled this rank (own_flags is this rank's flag array) with at
// least `epoch`.
__device__ __forceinline__ void wait_for_peer(const WaitContext& wait, const uint64_t* own_flags,
                                              int32_t peer, uint64_t epoch) {
  const uint64_t* flag = own_flags + peer;
  wait_until(
      wait, WaitSite::kPeerSignal, [&] { return load_flag(flag) >= epoch; },
      [&] { return static_cast<long long>(load_flag(flag)); }, static_cast<long long>(epoch));
}

// Launches of a one-directional transfer (push combine, push dispatch) end with one signal
// per rank: each CTA, after all of its stores, counts itself done on a local counter holding
// epoch * kDoneStride + CTAs done (raised with atomicMax first, so nothing is reset between
// calls and the CTA count may change); the last of `num_ctas` signals every rank. Called by one
// thread per CTA.
constexpr unsigned long long kDoneStride = 1ull << 24;  // > CTAs of one launch

__device__ __forceinline__ void count_done_and_signal(unsigned long long* done,
                                                      uint64_t* const* flag_peers, int32_t rank,
                                                      int32_t num_ranks, uint64_t epoch,
                                                      int64_t num_ctas) {
  asm volatile("fence.acq_rel.sys;" ::: "memory");
  atomicMax(done, epoch * kDoneStride);
  const unsigned long long before = atomicAdd(done, 1ull);
  if (before - epoch * kDoneStride == static_cast<unsigned long long>(num_ctas - 1))
    for (int32_t peer = 0; peer < num_ranks; ++peer) signal_peer(flag_peers[peer], rank, epoch);
}

}  // namespace mok::kernels
