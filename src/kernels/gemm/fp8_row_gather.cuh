// x's routed rows gathered and quantized inside the FP8 gate/up GEMM (Fp8GemmParams::row_gather;
// MoeConfig::fp8_gather_in_gate_up): the bits of launch_gather_quantize_fp8's row groups
// (fp8_gather_quantize.cu), written by the GEMM's spare producer warps while its TMA thread waits
// for each 64-row chunk of A, so that the forward has no pass of its own for them (as bf16's local
// dispatch gathers inside its GEMM: dispatch_local.cuh).
//
// Roles inside the producer warpgroup:
//   gatherer warps  claim schedule rows one at a time with a launch-wide ticket (any resident CTA
//                   takes any row, so progress does not depend on how many CTAs are resident),
//                   load the row's token from x (zeros for a padding row) and write its e4m3
//                   codes and 1 x 128 group scales into A, then count the row into its 64-row
//                   chunk. A half-warp holds a 128-long group: each lane 8 values (one 16-byte
//                   load), the group's amax by HMNMX2 and four shuffles, the lane's 8 codes as one
//                   8-byte store (the half-warp's: one whole 128-byte line), lane 0 of the half
//                   the scale. kInFlight pairs of groups are loaded before any is quantized.
//   TMA thread      before a tile's first K-block, waits for each of its chunks' counts.
// Ordering: a gatherer warp's stores -> __syncwarp -> lane 0's release-add of the chunk count (gpu
// scope) -> the TMA thread's acquire-load -> fence.proxy.async.global (the generic writes made
// visible to the async proxy) -> the TMA loads of A's codes and scales.
// Epochs: the ticket and the counts only grow; a launch with epoch e lifts them to its range with
// an idempotent atomicMax first (as dispatch_local.cuh's), and e lives in device memory, advanced
// by the caller after each launch, so nothing is reset and CUDA graph replays work.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/gemm/fp8_gemm.h"
#include "kernels/stages/dispatch_local.cuh"
#include "kernels/stages/fp8_group_tile.cuh"
#include "mok/fp8.h"

namespace mok::kernels {

static_assert(kTileCountStride > kFp8GatherChunkRows, "a chunk's count stays in its epoch's range");

__device__ __forceinline__ unsigned long long fp8_gather_epoch(const Fp8RowGather& gather) {
  return gather_epoch(gather.epoch);
}

// Run by each gatherer warp until the ticket passes the schedule's last row. `hidden`: H, the
// GEMM's K (a multiple of 128). Lean on registers (the 192-row kernel's producer warpgroup has
// 32 a thread): rows and tokens as 32-bit values, the addresses and the kernel's parameters made
// and read where used, and the epoch read from memory where used (it changes only between
// launches), so that little stays live across a row's groups.
template <int kInFlight>
__device__ __forceinline__ void fp8_gather_rows(const Fp8RowGather& gather,
                                                const ScheduleHeader* header, int hidden) {
  const int lane = threadIdx.x % 32;
  const int half = lane / 16, column = (lane % 16) * 8;
#pragma unroll 1
  for (;;) {
    unsigned long long claimed = 0;
    if (lane == 0) claimed = claim_gathered_row(gather.ticket, fp8_gather_epoch(gather));
    const int row = static_cast<int>(min(__shfl_sync(0xffffffffu, claimed, 0), 0x7fffffffull));
    if (row >= header->total_rows) return;
    const int32_t pair = gather.row_pair[row];
    const int token = pair >= 0 ? pair / gather.top_k : -1;  // -1: a padding row, zeros
    const int groups = hidden / 128;
#pragma unroll 1
    for (int group0 = 0; group0 < groups; group0 += 2 * kInFlight) {  // warp-uniform: shuffles
      uint4 values[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int group = group0 + 2 * u + half;
        values[u] = make_uint4(0, 0, 0, 0);
        if (token >= 0 && group < groups)  // the addresses made where used: fewer registers live
          values[u] = __ldg(reinterpret_cast<const uint4*>(
              static_cast<const __nv_bfloat16*>(gather.tokens) +
              static_cast<int64_t>(token) * hidden + group * 128 + column));
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int group = group0 + 2 * u + half;
        const uint4& v = values[u];
        uint32_t maximum = ptx::max_abs_bf16x2_nan(ptx::max_abs_bf16x2_nan(v.x, v.y),
                                                   ptx::max_abs_bf16x2_nan(v.z, v.w));
#pragma unroll
        for (int offset = 1; offset < 16; offset *= 2)  // within the half-warp: the group's lanes
          maximum = ptx::max_abs_bf16x2_nan(maximum, __shfl_xor_sync(0xffffffffu, maximum, offset));
        const Fp8GroupScale factors = fp8_group_scale(fp8_tile::halves_amax(maximum));
        if (group < groups) {
          *reinterpret_cast<uint2*>(gather.codes + static_cast<int64_t>(row) * hidden +
                                    group * 128 + column) =
              fp8_tile::codes8(v, factors.inverse_scale);
          if (column == 0) gather.scales[group * gather.capacity_rows + row] = factors.scale;
        }
      }
    }
    __syncwarp();
    if (lane == 0)
      count_gathered_row(gather.chunk_rows_done + row / kFp8GatherChunkRows,
                         fp8_gather_epoch(gather));
  }
}

// Run by the TMA thread before the first load of a tile whose A rows start at `row0`: waits until
// the `chunks` 64-row chunks from there are gathered.
__device__ __forceinline__ void fp8_wait_for_gathered_rows(const WaitContext& wait,
                                                           const Fp8RowGather& gather, int64_t row0,
                                                           int chunks, unsigned long long epoch) {
  for (int c = 0; c < chunks; ++c)
    wait_for_gathered_count(wait, gather.chunk_rows_done + row0 / kFp8GatherChunkRows + c, epoch,
                            kFp8GatherChunkRows);
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace mok::kernels
