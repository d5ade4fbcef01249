// wait_until: the one way device code spin-waits. Every wait has a timeout; on expiry it records
// who waited for what (rank, SM, block, thread, site, expected, seen, time waited) in host-mapped
// memory and aborts the kernel with a memory fault; the host runtime reads the record and
// reports it.
// So a missing peer or a bug ends in a diagnosis, never a hang.
#pragma once

#include <stdint.h>

#include "kernels/common/ptx.cuh"
#include "kernels/common/wait_types.h"

namespace mok::kernels {

// Ends the kernel with an error its host sees at the next synchronization: a store to the null
// address (an illegal-address fault), then a spin until the fault tears the grid down. Not
// `trap`: with a trap reachable from every wait, ptxas held the consumer warpgroups' code to
// the kernel's entry register count (168) instead of the 224 they own after setmaxnreg, and the
// persistent backward spilled its pipeline state in every mainloop (SASS: 199 local-memory
// instructions there with the trap, 18 without; docs/perf.md).
__device__ __forceinline__ void fault_kernel() {
  asm volatile("st.global.u32 [%0], %1;" ::"l"(0ull), "r"(1u) : "memory");
  for (;;) asm volatile("nanosleep.u32 1000;");
}

// Records the diagnosis and aborts the kernel. Deliberately inline with no calls (no printf):
// a call inside a wgmma pipeline region would make ptxas serialize the wgmmas.
__device__ __forceinline__ void abort_wait(const WaitContext& context, WaitSite site,
                                           long long expected, long long seen, uint64_t waited_ns) {
  if (context.diagnosis != nullptr) {
    volatile WaitDiagnosis* record = context.diagnosis;
    uint32_t sm_id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm_id));
    record->site = static_cast<int32_t>(site);
    record->rank = context.rank;
    record->sm = static_cast<int32_t>(sm_id);
    record->block = static_cast<int32_t>(blockIdx.x);
    record->thread = static_cast<int32_t>(threadIdx.x);
    record->expected = expected;
    record->seen = seen;
    record->waited_ns = waited_ns;
    __threadfence_system();
    record->timed_out = 1;
    __threadfence_system();
  }
  fault_kernel();
}

// Spins until ready() is true; after context.timeout_ns it records who waited for what and
// aborts. `seen()` is evaluated only for the diagnosis.
template <typename Ready, typename Seen>
__device__ __forceinline__ void wait_until(const WaitContext& context, WaitSite site, Ready ready,
                                           Seen seen, long long expected) {
  if (ready()) return;
  const uint64_t start = ptx::globaltimer_ns();
  for (uint32_t spin = 1;; ++spin) {
    if (ready()) return;
    if ((spin & 1023u) == 0) {
      const uint64_t waited = ptx::globaltimer_ns() - start;
      if (waited > context.timeout_ns)
        abort_wait(context, site, expected, static_cast<long long>(seen()), waited);
    }
  }
}

// Waits for phase `phase` of an mbarrier to complete.
__device__ __forceinline__ void mbarrier_wait(const WaitContext& context, WaitSite site,
                                              uint64_t* barrier, uint32_t phase) {
  wait_until(
      context, site, [&] { return ptx::mbarrier_try_wait(barrier, phase); }, [] { return 0; },
      phase);
}

// Acquire-load of a counter in global memory (another CTA or GPU releases it).
__device__ __forceinline__ int32_t load_acquire(const int32_t* address) {
  int32_t value;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(value) : "l"(address) : "memory");
  return value;
}

// Release-add to a counter: everything this thread wrote before is visible to whoever
// acquires the new value.
__device__ __forceinline__ void add_release(int32_t* address, int32_t value) {
  asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(address), "r"(value) : "memory");
}

// Waits until a counter reaches at least `target`.
__device__ __forceinline__ void wait_counter_at_least(const WaitContext& context,
                                                      const int32_t* counter, int32_t target) {
  wait_until(
      context, WaitSite::kCounter, [&] { return load_acquire(counter) >= target; },
      [&] { return load_acquire(counter); }, target);
}

}  // namespace mok::kernels
