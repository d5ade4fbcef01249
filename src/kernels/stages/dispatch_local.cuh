// The local dispatch fused into the forward gate/up GEMM: device functions run by the GEMM's
// producer warpgroup (see expert_gemm.cu).
//
// Roles inside the producer warpgroup:
//   warps 1-3  gatherers: claim rows of the schedule (of the launch's window: a macrobatch) one
//              at a time with a global ticket (any
//              resident CTA can take any row, so the kernel progresses with however many CTAs
//              are resident), copy x[token of the row] (or zeros for a padding row) into the row
//              buffer with 16-byte accesses, and count the row into its 128-row tile.
//   warp 0     lane 0, the TMA thread, waits for a tile's count to reach 128 before it loads the
//              tile's A rows.
// Expert parallel (FusedGather::peer_x set: MoeConfig::ep_dispatch_in_gemm), the gatherers are
// the pull dispatch: a row's source is its source rank's published x, read across NVLink, so
// the tiles whose rows have landed run while later rows are still in flight.
// Ordering: a gatherer warp's stores -> __syncwarp -> lane 0's release-add of the tile count
// (gpu scope, cumulative) -> the TMA thread's acquire-load -> fence.proxy.async.global (generic
// writes become visible to the async proxy) -> the TMA loads.
// Epochs: the ticket and the tile counts only grow. A launch with epoch e first lifts the ticket
// to e << 32 and each tile count to e * kTileCountStride with atomicMax (idempotent), so values
// left by earlier launches never satisfy this launch's waits, and nothing is reset between
// launches; e comes from device memory (advanced after each launch), so CUDA graph replays work.
#pragma once

#include <cuda_bf16.h>

#include "kernels/common/wait.cuh"
#include "kernels/gemm/expert_gemm_params.h"

namespace mok::kernels {

constexpr unsigned long long kTileCountStride = 256;  // > 128 rows per tile
constexpr int kGatherTileRows = 128;

// This launch's epoch, from the word the caller advances after each launch.
__device__ __forceinline__ unsigned long long gather_epoch(const unsigned long long* epoch_word) {
  return *reinterpret_cast<const volatile unsigned long long*>(epoch_word) + 1;
}
__device__ __forceinline__ unsigned long long gather_epoch(const FusedGather& gather) {
  return gather_epoch(gather.epoch);
}

// The source row of schedule row `row` (routed, not padding): this rank's x, or with peer_x
// the row of its source rank's published x (the receive list of the schedule names both).
__device__ __forceinline__ const uint4* gather_source_row(const FusedGather& gather, int64_t row,
                                                          int pair, int64_t vectors_per_row) {
  if (gather.peer_x == nullptr)
    return reinterpret_cast<const uint4*>(gather.x) +
           static_cast<int64_t>(pair / gather.top_k) * vectors_per_row;
  const int32_t entry = gather.row_recv[row];
  const int32_t source = recv_source_rank(gather.recv_offsets, gather.num_ranks, entry);
  return reinterpret_cast<const uint4*>(gather.peer_x[source]) +
         static_cast<int64_t>(gather.recv_tokens[entry]) * vectors_per_row;
}

__device__ __forceinline__ void release_add_u64(unsigned long long* address,
                                                unsigned long long value) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(address), "l"(value) : "memory");
}

// The next row of epoch `epoch` from the launch-wide `ticket` (run by one lane): its index from 0.
__device__ __forceinline__ unsigned long long claim_gathered_row(unsigned long long* ticket,
                                                                 unsigned long long epoch) {
  const unsigned long long ticket_base = epoch << 32;
  atomicMax(ticket, ticket_base);
  return atomicAdd(ticket, 1ull) - ticket_base;
}

// One gathered row counted into its tile's (or chunk's) `count` (run by one lane, after the
// warp's stores and a __syncwarp): lifted into epoch `epoch`'s range first, then released.
__device__ __forceinline__ void count_gathered_row(unsigned long long* count,
                                                   unsigned long long epoch) {
  atomicMax(count, epoch * kTileCountStride);
  release_add_u64(count, 1ull);
}

// Waits until `count` reaches `rows` gathered rows in epoch `epoch` (the caller fences the
// async proxy before its TMA loads).
__device__ __forceinline__ void wait_for_gathered_count(const WaitContext& wait,
                                                        const unsigned long long* count,
                                                        unsigned long long epoch, int rows) {
  const unsigned long long target = epoch * kTileCountStride + rows;
  wait_until(
      wait, WaitSite::kGatheredRows, [&] { return ptx::acquire_load_u64(count) >= target; },
      [&] {
        return static_cast<long long>(ptx::acquire_load_u64(count) - epoch * kTileCountStride);
      },
      rows);
}

// One row copied by the calling warp: lane l moves the 16-byte vectors l, l + 32, ..., kInFlight
// of them loaded before their stores (a row copy's speed is its warp's bytes in flight); `src`
// null: zeros (a padding row). `read_only`: the source does not change during the kernel
// (ld.global.nc); otherwise plain loads (another GPU's rows).
template <int kInFlight>
__device__ __forceinline__ void copy_row(const uint4* __restrict__ src, uint4* __restrict__ dst,
                                         int64_t vectors_per_row, int lane, bool read_only) {
  for (int64_t base = lane; base < vectors_per_row; base += 32 * kInFlight) {
    uint4 values[kInFlight];
#pragma unroll
    for (int u = 0; u < kInFlight; ++u) {
      values[u] = make_uint4(0, 0, 0, 0);
      if (src != nullptr && base + u * 32 < vectors_per_row)
        values[u] = read_only ? __ldg(src + base + u * 32) : src[base + u * 32];
    }
#pragma unroll
    for (int u = 0; u < kInFlight; ++u)
      if (base + u * 32 < vectors_per_row) dst[base + u * 32] = values[u];
  }
}

// Run by each gatherer warp until the ticket passes the last row.
__device__ __forceinline__ void gather_rows_into_tiles(const FusedGather& gather,
                                                       const ScheduleHeader* header,
                                                       const int32_t* row_pair,
                                                       unsigned long long epoch) {
  const int lane = threadIdx.x % 32;
  const int64_t end = gather.row_end < header->total_rows
                          ? gather.row_end
                          : static_cast<int64_t>(header->total_rows);
  const unsigned long long window_rows =
      end > gather.row_begin ? static_cast<unsigned long long>(end - gather.row_begin) : 0ull;
  const int64_t vectors_per_row = gather.hidden / 8;
  uint4* rows = reinterpret_cast<uint4*>(gather.rows);
  for (;;) {
    unsigned long long claimed = 0;
    if (lane == 0) claimed = claim_gathered_row(gather.ticket, epoch);
    claimed = __shfl_sync(0xffffffffu, claimed, 0);
    if (claimed >= window_rows) return;
    const int64_t row = gather.row_begin + static_cast<int64_t>(claimed);
    const int pair = row_pair[row];
    uint4* dst = rows + (row - gather.row_begin) * vectors_per_row;
    // Four vectors a lane in flight on the producer's 56 registers. Peer rows are read with
    // plain loads (another GPU's memory, written before the routing exchange).
    copy_row<4>(pair < 0 ? nullptr : gather_source_row(gather, row, pair, vectors_per_row), dst,
                vectors_per_row, lane, gather.peer_x == nullptr);
    __syncwarp();
    if (lane == 0) count_gathered_row(gather.tile_rows_done + row / kGatherTileRows, epoch);
  }
}

// Run by the TMA thread before the first load of a tile's A rows.
__device__ __forceinline__ void wait_for_gathered_tile(const WaitContext& wait,
                                                       const FusedGather& gather, int m_tile,
                                                       unsigned long long epoch) {
  wait_for_gathered_count(wait, gather.tile_rows_done + m_tile, epoch, kGatherTileRows);
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace mok::kernels
