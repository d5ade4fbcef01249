// MoeConfig::gemm_tiles_by_ticket (issue 16): the standalone expert GEMM's row-tile forms take
// their walk units from a launch-wide ticket counter instead of the static walk (CTA c: units
// c, c + grid, ...). The FP8 192-row tiles (fp8_gemm_192_rows.cu) always take theirs so, from
// the same counter and epoch form (their scheduler thread, not the producer, takes them).
//
// Why: in the static walk a CTA's lead or lag accumulates over its waves (after w waves, a CTA
// 1% faster is w% of a tile ahead), so CTAs that should read a weight tile together drift apart
// and read it from HBM twice (docs/perf.md, session 22: the four-stage ring's gate/up, 22 GB of
// DRAM against 11). By ticket, the units in flight are always a window of consecutive tickets:
// a slow CTA holds back only its own unit, for one unit's time, and nothing accumulates. Faster
// CTAs take more units, which also balances the 64-row tiles and the last wave. No CTA waits
// on another (unlike lockstep.h).
//
// How: the producer thread takes the next ticket one unit ahead (so the atomic's round trip
// passes under the current unit's loads), and hands each unit, with its 64-row-tile flag, to
// both consumer warpgroups through a queue in shared memory (persistent/task_queue.cuh); after
// the last unit it hands them a stop. The counter carries the launch's epoch (epoch << 32 |
// next ticket; the layer advances the epoch after each launch), so nothing is reset. Which
// tiles a CTA computes changes, how each is computed does not: the same bits.
#pragma once

#include <stdint.h>

namespace mok::kernels {

struct GemmTickets {
  unsigned long long* counter = nullptr;  // epoch << 32 | tickets taken; null: the static walk
  unsigned long long* epoch = nullptr;    // launches so far (the layer advances it)
};

// A unit handed from the producer to the consumers (kStopUnit: no more).
struct QueuedUnit {
  int32_t unit;
  int32_t half;  // the unit's row tile runs at 64 rows (half_row_tile)
};
inline constexpr int32_t kStopUnit = 0x7fffffff;

#if defined(__CUDACC__)

// The producer thread: this launch's ticket base, after lifting the counter to it.
__device__ __forceinline__ unsigned long long ticket_base(const GemmTickets& tickets) {
  const unsigned long long base =
      (*reinterpret_cast<const volatile unsigned long long*>(tickets.epoch) + 1ull) << 32;
  atomicMax(tickets.counter, base);
  return base;
}

// The next unit of the launch (past the last: no more).
__device__ __forceinline__ int32_t take_unit(const GemmTickets& tickets, unsigned long long base,
                                             int32_t num_units) {
  const unsigned long long ticket = atomicAdd(tickets.counter, 1ull) - base;
  return ticket < static_cast<unsigned long long>(num_units) ? static_cast<int32_t>(ticket)
                                                             : kStopUnit;
}

#endif  // __CUDACC__

}  // namespace mok::kernels
