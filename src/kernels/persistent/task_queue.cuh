// The persistent kernels' hand-off from the scheduler thread to the consumer warpgroups, and
// their dependency counters (forward_gemms.cu, backward_gemms.cu).
//
// Queue: kQueueSlots slots in shared memory, each with a `full` mbarrier (one arrival: the
// scheduler published the slot) and an `empty` mbarrier (one arrival per reader thread, after
// its own read: one arrival per warp after a warp barrier is ordered too, but compute-sanitizer
// racecheck does not see the warp barrier's ordering and reported the slot's reuse). The
// scheduler writes tasks in order; the consumers read them in the same order, so each side only
// counts: slot = count % kQueueSlots, phase = (count / kQueueSlots) & 1. A task whose `kind` is
// kStopTask ends the consumers' loop.
//
// Counters: global words that only grow. A launch's value is epoch * kGateUpDoneStride + tasks
// done (expert_gemm_params.h): the first producer of a launch lifts the word to its epoch's
// floor with atomicMax, and every producer release-adds one, so nothing is ever reset (graph
// replays and repeated launches work).
#pragma once

#include <stdint.h>

#include "kernels/common/ptx.cuh"
#include "kernels/common/wait.cuh"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_mainloop.cuh"

namespace mok::kernels {

constexpr int kQueueSlots = 4;
constexpr int32_t kStopTask = -1;

template <typename Task>
struct TaskQueue {
  Task slot[kQueueSlots];
  uint64_t full[kQueueSlots];
  uint64_t empty[kQueueSlots];

  // Thread 0, before the CTA's first barrier (init_pipeline fences and syncs after it); the
  // kConsumerThreads consumer threads read every task (each frees the slot once).
  __device__ __forceinline__ void init() {
    for (int s = 0; s < kQueueSlots; ++s) {
      ptx::mbarrier_init(&full[s], 1);
      ptx::mbarrier_init(&empty[s], kConsumerThreads);
    }
  }

  // The scheduler: waits for slot `count` to be free, writes `task` there, publishes it.
  __device__ __forceinline__ void publish(const WaitContext& wait, uint32_t count,
                                          const Task& task) {
    const int s = static_cast<int>(count % kQueueSlots);
    mbarrier_wait(wait, WaitSite::kTaskQueueSlot, &empty[s], ((count / kQueueSlots) & 1) ^ 1);
    slot[s] = task;
    ptx::mbarrier_arrive(&full[s]);
  }

  // A reader thread: waits for task `count`, reads it, and frees the slot (its arrival).
  __device__ __forceinline__ Task read(const WaitContext& wait, uint32_t count) {
    const int s = static_cast<int>(count % kQueueSlots);
    mbarrier_wait(wait, WaitSite::kQueuedTask, &full[s], (count / kQueueSlots) & 1);
    const Task task = slot[s];
    ptx::mbarrier_arrive(&empty[s]);
    return task;
  }
};

// Counts one finished task on `counter` for this launch's `epoch`.
__device__ __forceinline__ void count_done(unsigned long long* counter, unsigned long long epoch) {
  atomicMax(counter, epoch * kGateUpDoneStride);
  asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(counter) : "memory");
}

// Run by the thread that issued a tile's TMA stores: once they are complete, the tile is in
// global memory for the tasks that wait on `counter` (which fence the async proxy before their
// TMA loads).
__device__ __forceinline__ void count_stored_tile(unsigned long long* counter,
                                                  unsigned long long epoch) {
  ptx::bulk_wait_group<0>();
  asm volatile("fence.proxy.async.global;" ::: "memory");
  count_done(counter, epoch);
}

// After a counter's acquire: the task's TMA loads read what other CTAs wrote.
__device__ __forceinline__ void acquire_for_tma() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

// What the consumer warpgroups hold while they run a task (forward_tasks.cuh, backward_tasks.cuh).
struct TaskConsumerScope {
  const WaitContext& wait;
  GemmSharedStorage<kNumStages>& smem;
  PipelineState<kNumStages>& state;
  int consumer_idx;  // 0, 1: the warpgroup's half of the tile
  bool issuer;       // the thread that issues the epilogue's TMA stores and signals
  unsigned long long epoch;
};

// Waits until `counter` reaches epoch * kGateUpDoneStride + `count` (diagnosis: `site`, expected
// and seen as counts of this launch).
__device__ __forceinline__ void wait_for_count(const WaitContext& wait, WaitSite site,
                                               const unsigned long long* counter,
                                               unsigned long long epoch, int64_t count) {
  const unsigned long long target = epoch * kGateUpDoneStride + count;
  wait_until(
      wait, site, [&] { return ptx::acquire_load_u64(counter) >= target; },
      [&] {
        return static_cast<long long>(ptx::acquire_load_u64(counter) - epoch * kGateUpDoneStride);
      },
      count);
}

}  // namespace mok::kernels
