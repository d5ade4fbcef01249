// MoeConfig::gemm_lockstep_k_blocks (issue 16): the standalone expert GEMM's row-tile forms keep
// their CTAs in step.
//
// Why: the CTAs that run together share the weight tile of one expert and the activation rows of
// a group through L2 (tile_walk.h). With one stage of the ring loading, a CTA's K-block time is
// set by its loads, so a CTA ahead of its partners (the first to ask for a line) waits on HBM
// and the ones behind hit in L2 and catch up: the walk keeps itself in step. With two stages
// loading (MoeConfig::gemm_four_stages) the math sets the pace, nothing pulls a CTA back, and
// the CTAs drift apart until they read the same lines from HBM twice (docs/perf.md, session 22:
// the four-stage gate/up at dsv3_e128 read 22 GB of DRAM against 11).
//
// How: a launch's producer threads count their progress in ticks of tick_k_blocks K-blocks
// (tick t of a CTA: its local unit t / ticks_per_unit, K-block (t % ticks_per_unit) *
// tick_k_blocks). Reaching tick t, a producer adds itself to ticks[t], then waits until every
// CTA of the launch that has started has passed tick t - kLockstepLagTicks: no CTA runs more
// than about lead_k_blocks ahead of the slowest. It reads the counter it will wait on one tick
// early, so a CTA in the pack pays no load latency. A CTA that ends with fewer units than the
// most any CTA has marks the ticks it will never reach, so nobody waits on it.
//
// Never a hang: a CTA waits only on CTAs that have started, which hold their SMs and wait only
// on ticks below their own; the slowest started CTA never waits. CTAs that start late (another
// stream holding SMs) are counted from their start and caught up with. The wait is a
// wait_until with its timeout and diagnosis (WaitSite::kLockstep).
//
// Counters carry the launch's epoch (ticks[t] = epoch << 32 | CTAs past t; the layer advances
// the epoch after each launch), so nothing is reset between launches. Timing only: which CTA
// computes which tile, and how, do not change, so neither do the bits.
#pragma once

#include <stdint.h>

#include "mok/dtype.h"

#if defined(__CUDACC__)
#include "kernels/common/wait.cuh"
#endif

namespace mok::kernels {

// Ticks a launch may count (the counter words of the layer's lockstep buffer).
inline constexpr int32_t kLockstepTicks = 16384;
// A CTA at tick t waits for every started CTA to pass tick t - kLockstepLagTicks.
inline constexpr int32_t kLockstepLagTicks = 4;

struct GemmLockstep {
  unsigned long long* ticks = nullptr;    // [kLockstepTicks]; null: off
  unsigned long long* started = nullptr;  // epoch << 32 | CTAs started
  unsigned long long* epoch = nullptr;    // launches so far (the layer advances it)
  int32_t lead_k_blocks = 0;              // MoeConfig::gemm_lockstep_k_blocks
};

struct LockstepPlan {
  int32_t tick_k_blocks = 0;   // 0: off for this launch
  int32_t ticks_per_unit = 0;  // ceil(num_k_blocks / tick_k_blocks)
  int32_t max_ticks = 0;       // the ticks of the CTA with the most units
};

// A launch's ticks: lead_k_blocks / kLockstepLagTicks K-blocks each (at least one, at most a
// unit's), coarsened by doubling until the CTA with the most units (max_units) counts at most
// kLockstepTicks. Off where even one tick per unit is too many, or nothing runs.
MOK_HOST_DEVICE inline LockstepPlan lockstep_plan(int32_t lead_k_blocks, int32_t num_k_blocks,
                                                  int32_t max_units) {
  if (lead_k_blocks <= 0 || num_k_blocks <= 0 || max_units <= 0) return LockstepPlan{};
  int32_t tick = lead_k_blocks / kLockstepLagTicks;
  if (tick < 1) tick = 1;
  if (tick > num_k_blocks) tick = num_k_blocks;
  for (;;) {
    const int32_t per_unit = (num_k_blocks + tick - 1) / tick;
    const int64_t total = static_cast<int64_t>(max_units) * per_unit;
    if (total <= kLockstepTicks) {
      LockstepPlan plan;
      plan.tick_k_blocks = tick;
      plan.ticks_per_unit = per_unit;
      plan.max_ticks = static_cast<int32_t>(total);
      return plan;
    }
    if (tick == num_k_blocks) return LockstepPlan{};
    tick = tick * 2 < num_k_blocks ? tick * 2 : num_k_blocks;
  }
}

// The tick a CTA at `tick` waits for every started CTA to have passed (negative: none).
MOK_HOST_DEVICE inline int32_t lockstep_waits_for(int32_t tick) { return tick - kLockstepLagTicks; }

// The ticks a CTA that walked `units` units marks when it ends, [first, end): those it did not
// reach that a CTA with more units may wait on.
struct LockstepTickRange {
  int32_t first;
  int32_t end;
};
MOK_HOST_DEVICE inline LockstepTickRange lockstep_unreached_ticks(const LockstepPlan& plan,
                                                                  int32_t units) {
  return {units * plan.ticks_per_unit, lockstep_waits_for(plan.max_ticks)};
}

#if defined(__CUDACC__)

// One producer thread's place in its launch's lockstep: six registers (the producer warps run
// on kProducerRegisters). A CTA passes its ticks 0, 1, 2, ... in order, so the counters read at
// tick t are always those of tick t + 1's wait.
struct LockstepCta {
  LockstepPlan plan;
  uint32_t epoch = 0;  // this launch's: the counter words' high half
  // At tick t - 1: the started count and tick t - kLockstepLagTicks's count, for tick t.
  uint32_t prefetched_tick = 0, prefetched_started = 0;
};

namespace lockstep_detail {

// The count of a counter word: its low half. Every word a CTA reads it has itself marked in this
// launch (the started word, and ticks below its own), so the high half is this launch's epoch.
// Relaxed: the counters only pace the producers; no data is published through them.
__device__ __forceinline__ uint32_t count(const unsigned long long* address) {
  uint32_t value;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];"
               : "=r"(value)
               : "l"(reinterpret_cast<const uint32_t*>(address))
               : "memory");
  return value;
}
// Adds one to a counter word for this launch: raised to the epoch first (same-address
// operations of one thread keep their order), so an earlier launch's count is dropped.
__device__ __forceinline__ void add_one(unsigned long long* address, uint32_t epoch) {
  const unsigned long long base = static_cast<unsigned long long>(epoch) << 32;
  asm volatile("red.relaxed.gpu.global.max.u64 [%0], %1;" ::"l"(address), "l"(base) : "memory");
  asm volatile("red.relaxed.gpu.global.add.u64 [%0], %1;" ::"l"(address), "l"(1ull) : "memory");
}

}  // namespace lockstep_detail

// The producer thread at its first unit: counts itself as started. `plan` off: nothing.
__device__ __forceinline__ LockstepCta lockstep_begin(const GemmLockstep& lockstep,
                                                      const LockstepPlan& plan) {
  LockstepCta cta;
  cta.plan = plan;
  if (plan.tick_k_blocks == 0) return cta;
  cta.epoch = static_cast<uint32_t>(
      *reinterpret_cast<const volatile unsigned long long*>(lockstep.epoch) + 1ull);
  lockstep_detail::add_one(lockstep.started, cta.epoch);
  return cta;
}

// Before the loads of K-block `k_block` of the CTA's `local_unit`-th unit: at each tick, marks
// it and waits for the slowest started CTA to be within kLockstepLagTicks.
__device__ __forceinline__ void lockstep_k_block(const GemmLockstep& lockstep, LockstepCta& cta,
                                                 const WaitContext& wait, int32_t local_unit,
                                                 int32_t k_block) {
  using namespace lockstep_detail;
  if (cta.plan.tick_k_blocks == 0 || k_block % cta.plan.tick_k_blocks != 0) return;
  const int32_t tick = local_unit * cta.plan.ticks_per_unit + k_block / cta.plan.tick_k_blocks;
  add_one(lockstep.ticks + tick, cta.epoch);
  const int32_t behind = lockstep_waits_for(tick);
  // The counters read at the previous tick may already show every started CTA past `behind`.
  if (behind >= 0 && cta.prefetched_tick < cta.prefetched_started) {
    const unsigned long long* counter = lockstep.ticks + behind;
    wait_until(
        wait, WaitSite::kLockstep, [&] { return count(counter) >= count(lockstep.started); },
        [&] { return static_cast<long long>(count(counter)); },
        static_cast<long long>(count(lockstep.started)));
  }
  // The next tick's wait, read now: its latency passes under this tick's K-blocks.
  if (behind + 1 >= 0) {
    cta.prefetched_started = count(lockstep.started);
    cta.prefetched_tick = count(lockstep.ticks + behind + 1);
  }
}

// The producer thread after its `units` units: marks the ticks it did not reach that a CTA
// with more units may wait on.
__device__ __forceinline__ void lockstep_end(const GemmLockstep& lockstep, const LockstepCta& cta,
                                             int32_t units) {
  if (cta.plan.tick_k_blocks == 0) return;
  const LockstepTickRange unreached = lockstep_unreached_ticks(cta.plan, units);
  for (int32_t tick = unreached.first; tick < unreached.end; ++tick)
    lockstep_detail::add_one(lockstep.ticks + tick, cta.epoch);
}

#endif  // __CUDACC__

}  // namespace mok::kernels
