// Recording the persistent kernels' task traces (mok/task_trace.h; MoeConfig::trace_tasks): the
// scheduler thread writes when it began with a ticket and when the ticket's task was queued,
// the thread that runs a task's epilogue (the first consumer thread) when it was read and
// finished. Events are indexed by ticket, so no two threads race for a slot; the host
// fills the buffer with 0xff bytes before a traced launch. Off (null events): one predictable
// branch per task.
#pragma once

#include <stdint.h>

#include "kernels/common/ptx.cuh"
#include "kernels/gemm/expert_gemm_params.h"

namespace mok::kernels {

// When the scheduler began with a ticket (0 when not tracing: no timer read).
__device__ __forceinline__ uint64_t trace_clock(const TaskTraceArgs& trace) {
  return trace.events != nullptr ? ptx::globaltimer_ns() : 0;
}

__device__ __forceinline__ bool tracing(const TaskTraceArgs& trace, long long ticket) {
  return trace.events != nullptr && ticket >= 0 && ticket < trace.capacity;
}

// The scheduler: `ticket`'s task is queued; it began with the ticket at `ticket_ns`, had
// decoded it at `decoded_ns` and began waiting for its dependency at `wait_ns`.
__device__ __forceinline__ void trace_queued(const TaskTraceArgs& trace, long long ticket,
                                             int32_t kind, int32_t m_tile, int32_t n_tile,
                                             int32_t expert, uint64_t ticket_ns,
                                             uint64_t decoded_ns, uint64_t wait_ns) {
  if (!tracing(trace, ticket)) return;
  uint32_t sm;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
  TaskTraceEvent& event = trace.events[ticket];
  event.ticket_ns = ticket_ns;
  event.ready_ns = ptx::globaltimer_ns();
  event.kind = kind;
  event.sm = static_cast<int32_t>(sm);
  event.m_tile = m_tile;
  event.n_tile = n_tile;
  event.expert = expert;
  event.decode_ns = static_cast<uint32_t>(decoded_ns - ticket_ns);
  event.dependency_ns = static_cast<uint32_t>(event.ready_ns - wait_ns);
}

// The consumers: they read `ticket`'s task.
__device__ __forceinline__ void trace_started(const TaskTraceArgs& trace, long long ticket) {
  if (!tracing(trace, ticket)) return;
  trace.events[ticket].start_ns = ptx::globaltimer_ns();
}

// The consumers: they finished `ticket`'s task.
__device__ __forceinline__ void trace_finished(const TaskTraceArgs& trace, long long ticket) {
  if (!tracing(trace, ticket)) return;
  trace.events[ticket].end_ns = ptx::globaltimer_ns();
}

}  // namespace mok::kernels
