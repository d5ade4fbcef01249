// The expert GEMMs' lockstep (src/kernels/gemm/lockstep.h, MoeConfig::gemm_lockstep_k_blocks):
// the tick plan of a launch, and the protocol the producers follow, stepped on the CPU with the
// header's rules: CTAs of unequal unit counts at random speeds, some starting only when another
// ends (fewer SMs than CTAs), always finish, and CTAs that start together stay within the lag.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "kernels/gemm/lockstep.h"

namespace mok::kernels {
namespace {

TEST(LockstepPlan, TicksOfTheLeadOverTheLag) {
  const LockstepPlan plan = lockstep_plan(16, 112, 39);
  EXPECT_EQ(plan.tick_k_blocks, 16 / kLockstepLagTicks);
  EXPECT_EQ(plan.ticks_per_unit, 28);
  EXPECT_EQ(plan.max_ticks, 39 * 28);
  // A lead below the lag ticks every K-block; a tick never spans more than a unit.
  EXPECT_EQ(lockstep_plan(2, 112, 39).tick_k_blocks, 1);
  const LockstepPlan whole = lockstep_plan(4096, 32, 10);
  EXPECT_EQ(whole.tick_k_blocks, 32);
  EXPECT_EQ(whole.ticks_per_unit, 1);
  // K-blocks that do not divide by the tick: the unit's last tick is short.
  EXPECT_EQ(lockstep_plan(16, 30, 5).ticks_per_unit, 8);
}

TEST(LockstepPlan, CoarsensToFitTheCounters) {
  // 2000 units of 112 K-blocks ticked every 4: 56,000 ticks, too many; doubled until they fit.
  const LockstepPlan plan = lockstep_plan(16, 112, 2000);
  ASSERT_GT(plan.tick_k_blocks, 0);
  EXPECT_LE(plan.max_ticks, kLockstepTicks);
  EXPECT_EQ(plan.tick_k_blocks, 16);
  EXPECT_EQ(plan.max_ticks, 2000 * 7);
  // More units than counters even at one tick per unit: off.
  EXPECT_EQ(lockstep_plan(16, 112, kLockstepTicks + 1).tick_k_blocks, 0);
  EXPECT_EQ(lockstep_plan(0, 112, 10).tick_k_blocks, 0);
  EXPECT_EQ(lockstep_plan(16, 0, 10).tick_k_blocks, 0);
  EXPECT_EQ(lockstep_plan(16, 112, 0).tick_k_blocks, 0);
}

// One producer of the simulated launch, following lockstep.h's device functions: begin counts
// it started; at each tick it marks the tick, passes if the counters it read at the previous
// tick already show every started CTA past lockstep_waits_for(tick), else waits for the live
// ones; then reads the next tick's counters; at its end it marks lockstep_unreached_ticks.
struct SimCta {
  int32_t units = 0;
  bool started = false, finished = false, waiting = false;
  int32_t unit = 0, k_block = 0;
  int32_t marked = -1;  // the last tick marked
  int32_t prefetched_tick = 0, prefetched_started = 0;
};

struct Launch {
  LockstepPlan plan;
  std::vector<int32_t> ticks;
  int32_t started = 0;
};

int32_t tick_of(const Launch& launch, const SimCta& cta) {
  return cta.unit * launch.plan.ticks_per_unit + cta.k_block / launch.plan.tick_k_blocks;
}

// The counters read for the next tick's wait.
void prefetch(const Launch& launch, SimCta& cta) {
  const int32_t next = lockstep_waits_for(cta.marked) + 1;
  if (next < 0) return;
  cta.prefetched_started = launch.started;
  cta.prefetched_tick = launch.ticks[next];
}

// Tries to move `cta` one K-block on; false while it waits.
bool step(Launch& launch, SimCta& cta) {
  if (cta.k_block % launch.plan.tick_k_blocks == 0 && cta.marked != tick_of(launch, cta)) {
    const int32_t tick = tick_of(launch, cta);
    EXPECT_EQ(tick, cta.marked + 1) << "ticks are passed in order";
    ++launch.ticks[tick];
    cta.marked = tick;
    if (lockstep_waits_for(tick) >= 0 && cta.prefetched_tick < cta.prefetched_started)
      cta.waiting = true;
    else
      prefetch(launch, cta);
  }
  if (cta.waiting) {
    if (launch.ticks[lockstep_waits_for(cta.marked)] < launch.started) return false;
    cta.waiting = false;
    prefetch(launch, cta);
  }
  return true;
}

void advance(Launch& launch, SimCta& cta, int32_t num_k_blocks) {
  if (++cta.k_block < num_k_blocks) return;
  cta.k_block = 0;
  if (++cta.unit < cta.units) return;
  cta.finished = true;
  const LockstepTickRange unreached = lockstep_unreached_ticks(launch.plan, cta.units);
  for (int32_t tick = unreached.first; tick < unreached.end; ++tick) ++launch.ticks[tick];
}

// Runs a launch of `units` (per CTA) on `sms` SMs to the end; returns the largest spread in
// ticks (the last each marked) between started, unfinished CTAs, when all start at once.
int32_t simulate(const std::vector<int32_t>& units, int32_t num_k_blocks, int32_t lead, int32_t sms,
                 uint32_t seed) {
  Launch launch;
  launch.plan = lockstep_plan(lead, num_k_blocks, *std::max_element(units.begin(), units.end()));
  EXPECT_GT(launch.plan.tick_k_blocks, 0);
  launch.ticks.assign(launch.plan.max_ticks, 0);
  std::vector<SimCta> ctas(units.size());
  for (size_t c = 0; c < units.size(); ++c) ctas[c].units = units[c];
  std::mt19937 rng(seed);
  const bool all_at_once = sms >= static_cast<int32_t>(units.size());
  int32_t running = 0, spread = 0;
  for (int64_t steps = 0;; ++steps) {
    // CTAs start as SMs free up, in an order the hardware does not promise (random here; a CTA
    // without units never counts itself started).
    std::vector<size_t> waiting;
    for (size_t c = 0; c < ctas.size(); ++c)
      if (!ctas[c].started) waiting.push_back(c);
    std::shuffle(waiting.begin(), waiting.end(), rng);
    for (size_t c : waiting) {
      if (running >= sms) break;
      SimCta& cta = ctas[c];
      cta.started = true;
      if (cta.units == 0) {
        cta.finished = true;
        continue;
      }
      ++launch.started;
      ++running;
    }
    std::vector<size_t> live;
    for (size_t c = 0; c < ctas.size(); ++c)
      if (ctas[c].started && !ctas[c].finished) live.push_back(c);
    if (live.empty()) break;
    if (all_at_once) {
      int32_t lo = launch.plan.max_ticks, hi = 0;
      for (size_t c : live) {
        lo = std::min(lo, ctas[c].marked);
        hi = std::max(hi, ctas[c].marked);
      }
      spread = std::max(spread, hi - lo);
    }
    // A random runnable CTA moves (random speeds); none runnable is a deadlock.
    std::shuffle(live.begin(), live.end(), rng);
    bool moved = false;
    for (size_t c : live) {
      if (!step(launch, ctas[c])) continue;
      advance(launch, ctas[c], num_k_blocks);
      if (ctas[c].finished) --running;
      moved = true;
      break;
    }
    if (!moved) {
      ADD_FAILURE() << "every running CTA waits: a deadlock after " << steps << " steps";
      return -1;
    }
  }
  for (const SimCta& cta : ctas) EXPECT_TRUE(cta.finished);
  return spread;
}

TEST(LockstepProtocol, CtasStartedTogetherStayWithinTheLag) {
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    SCOPED_TRACE(seed);
    // 20 CTAs of 5 or 6 units (a launch's tail), K-blocks of 64 ticked every 4.
    std::vector<int32_t> units(20, 5);
    for (int c = 0; c < 7; ++c) units[c] = 6;
    const int32_t spread = simulate(units, 64, 16, 20, seed);
    // A CTA marks a tick before it waits there: marked ticks spread the lag plus that one.
    EXPECT_LE(spread, kLockstepLagTicks + 1);
    EXPECT_GE(spread, 1);  // the CTAs do move apart, within the bound
  }
}

TEST(LockstepProtocol, NeverHangsWithUnequalCtasOrFewerSms) {
  for (uint32_t seed = 1; seed <= 5; ++seed) {
    SCOPED_TRACE(seed);
    // The L2 placement's two halves walk different unit counts; some CTAs have none.
    const std::vector<int32_t> units = {9, 9, 9, 4, 4, 4, 4, 0, 8, 3};
    simulate(units, 28, 8, 10, seed);
    // Fewer SMs than CTAs: the last CTAs start only once others end.
    simulate(units, 28, 8, 6, seed);
    simulate(std::vector<int32_t>(12, 3), 7, 2, 5, seed);
  }
}

}  // namespace
}  // namespace mok::kernels
