// Task traces of the persistent kernels (MoeConfig::trace_tasks): for every ticket of a launch,
// when its scheduler took it, had decoded it and saw its dependency met, and when the consumer
// warps started and finished it, read from %globaltimer. A profiling aid: it says where a
// persistent kernel's SMs wait (for a dependency, for the scheduler, in the mainloop), which
// the kernel's total time cannot.
//
// The event layout is shared by the kernels and the host (plain data).
#pragma once

#include <stdint.h>

#include <string>
#include <vector>

namespace mok {

struct TaskTraceEvent {
  uint64_t ticket_ns;      // the scheduler began with the ticket
  uint64_t ready_ns;       // its dependency was met and it was queued
  uint64_t start_ns;       // the consumer warps read it from the queue
  uint64_t end_ns;         // they finished it (last stores issued, counters signalled)
  int32_t kind;            // the kernel's task kind (TaskTrace::kind_names); -1: no task recorded
  int32_t sm;              // %smid of the CTA that ran it
  int32_t m_tile;          // row tile, or the weight-gradient tile's M index
  int32_t n_tile;          // column tile, -1 where none
  int32_t expert;          // the task's expert, -1 where none
  uint32_t decode_ns;      // the scheduler decoding the ticket (from ticket_ns)
  uint32_t dependency_ns;  // then waiting for its dependency (until ready_ns)
  int32_t unused;
};
static_assert(sizeof(TaskTraceEvent) == 64, "TaskTraceEvent is shared with the kernels");

// One launch of a persistent kernel, events indexed by ticket.
struct TaskTrace {
  std::string kernel;                   // "persistent forward" / "persistent backward"
  std::vector<std::string> kind_names;  // by TaskTraceEvent::kind
  std::vector<TaskTraceEvent> events;
};

// Where a launch's SM time went, per task kind: tasks, their mean and total time from start to
// end, the mean time the scheduler took to decode the ticket and then to see its dependency
// met, and the SM time idle before the kind's tasks (the consumers waiting for the queue); then
// the launch's span, the SMs, and the busy fraction. Plain text, one line per kind.
std::string summarize_task_trace(const TaskTrace& trace);

// Writes the traces as a Chrome / Perfetto trace (JSON: one process per trace, one thread per
// SM, one slice per task). Throws mok::Error naming the path if it cannot be written.
void write_chrome_trace(const std::vector<TaskTrace>& traces, const std::string& path);

}  // namespace mok
