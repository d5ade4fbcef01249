// Summaries and Chrome traces of the persistent kernels' task traces (mok/task_trace.h).
#include "mok/task_trace.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "mok/error.h"

namespace mok {

namespace {

bool recorded(const TaskTraceEvent& event) {
  // The buffer is filled with 0xff bytes before a traced launch: a field still UINT64_MAX was
  // never written (a ticket without a traced task, or a kernel that stopped early).
  return event.kind >= 0 && event.ticket_ns != UINT64_MAX && event.ready_ns != UINT64_MAX &&
         event.start_ns != UINT64_MAX && event.end_ns != UINT64_MAX &&
         event.end_ns >= event.start_ns && event.ready_ns >= event.ticket_ns;
}

std::string kind_name(const TaskTrace& trace, int32_t kind) {
  if (kind >= 0 && kind < static_cast<int32_t>(trace.kind_names.size()))
    return trace.kind_names[static_cast<size_t>(kind)];
  return "kind " + std::to_string(kind);
}

struct KindTotals {
  int64_t tasks = 0;
  double busy_ns = 0;         // start -> end
  double decode_ns = 0;       // ticket -> decoded
  double dependency_ns = 0;   // waiting for the dependency -> ready
  double idle_before_ns = 0;  // the consumers' gap before the task
};

std::string json_escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

std::string summarize_task_trace(const TaskTrace& trace) {
  std::vector<const TaskTraceEvent*> events;
  for (const TaskTraceEvent& event : trace.events)
    if (recorded(event)) events.push_back(&event);
  std::ostringstream out;
  if (events.empty()) {
    out << trace.kernel << ": no tasks recorded\n";
    return out.str();
  }
  uint64_t begin = UINT64_MAX, end = 0;
  for (const TaskTraceEvent* event : events) {
    begin = std::min(begin, event->ticket_ns);
    end = std::max(end, event->end_ns);
  }
  // Each SM's timeline in start order: the gap before a task is the consumers' idle time
  // waiting for it (its dependency, the scheduler, the queue).
  std::map<int32_t, std::vector<const TaskTraceEvent*>> by_sm;
  for (const TaskTraceEvent* event : events) by_sm[event->sm].push_back(event);
  std::map<int32_t, KindTotals> totals;  // by kind
  double head_ns = 0, tail_ns = 0, busy_ns = 0;
  for (auto& [sm, list] : by_sm) {
    std::sort(list.begin(), list.end(), [](const TaskTraceEvent* a, const TaskTraceEvent* b) {
      return a->start_ns < b->start_ns;
    });
    uint64_t previous_end = 0;
    for (const TaskTraceEvent* event : list) {
      KindTotals& kind = totals[event->kind];
      if (previous_end == 0)
        head_ns += static_cast<double>(event->start_ns - begin);
      else if (event->start_ns > previous_end)
        kind.idle_before_ns += static_cast<double>(event->start_ns - previous_end);
      previous_end = std::max(previous_end, event->end_ns);
    }
    tail_ns += static_cast<double>(end - previous_end);
  }
  for (const TaskTraceEvent* event : events) {
    KindTotals& kind = totals[event->kind];
    kind.tasks += 1;
    kind.busy_ns += static_cast<double>(event->end_ns - event->start_ns);
    kind.decode_ns += event->decode_ns;
    kind.dependency_ns += event->dependency_ns;
    busy_ns += static_cast<double>(event->end_ns - event->start_ns);
  }
  const double sms = static_cast<double>(by_sm.size());
  const double span_ns = static_cast<double>(end - begin);
  char line[256];
  std::snprintf(line, sizeof line,
                "%s: %zu tasks on %zu SMs, span %.3f ms, consumer warps busy %.1f%% of it\n",
                trace.kernel.c_str(), events.size(), by_sm.size(), span_ns * 1e-6,
                sms > 0 ? 100.0 * busy_ns / (span_ns * sms) : 0.0);
  out << line;
  std::snprintf(line, sizeof line, "  %-20s %7s %9s %11s %10s %10s %12s\n", "task", "tasks",
                "mean us", "busy ms/SM", "decode us", "dep. us", "idle ms/SM");
  out << line;
  for (const auto& [kind_index, kind] : totals) {
    const std::string name = kind_name(trace, kind_index);
    std::snprintf(line, sizeof line, "  %-20s %7lld %9.2f %11.3f %10.2f %10.2f %12.3f\n",
                  name.c_str(), static_cast<long long>(kind.tasks),
                  kind.busy_ns * 1e-3 / kind.tasks, kind.busy_ns * 1e-6 / sms,
                  kind.decode_ns * 1e-3 / kind.tasks, kind.dependency_ns * 1e-3 / kind.tasks,
                  kind.idle_before_ns * 1e-6 / sms);
    out << line;
  }
  out << "  (idle ms/SM: the consumers' gaps before the kind's tasks, per SM)\n";
  std::snprintf(line, sizeof line,
                "  idle per SM: %.3f ms before its first task, %.3f ms after its last\n",
                head_ns * 1e-6 / sms, tail_ns * 1e-6 / sms);
  out << line;
  return out.str();
}

void write_chrome_trace(const std::vector<TaskTrace>& traces, const std::string& path) {
  std::ofstream file(path);
  if (!file)
    throw Error(ErrorCode::kInvalidArgument,
                "task trace: cannot write `" + path + "`; expected a writable file path");
  uint64_t begin = UINT64_MAX;
  for (const TaskTrace& trace : traces)
    for (const TaskTraceEvent& event : trace.events)
      if (recorded(event)) begin = std::min(begin, event.ticket_ns);
  file << "{\"traceEvents\": [\n";
  bool first = true;
  char buffer[512];
  for (size_t p = 0; p < traces.size(); ++p) {
    const TaskTrace& trace = traces[p];
    std::snprintf(buffer, sizeof buffer,
                  "%s{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": %zu, \"args\": "
                  "{\"name\": \"%s\"}}",
                  first ? "" : ",\n", p, json_escape(trace.kernel).c_str());
    file << buffer;
    first = false;
    for (size_t ticket = 0; ticket < trace.events.size(); ++ticket) {
      const TaskTraceEvent& event = trace.events[ticket];
      if (!recorded(event)) continue;
      std::snprintf(buffer, sizeof buffer,
                    ",\n{\"name\": \"%s\", \"ph\": \"X\", \"pid\": %zu, \"tid\": %lld, "
                    "\"ts\": %.3f, \"dur\": %.3f, \"args\": {\"ticket\": %zu, \"m\": %d, "
                    "\"n\": %d, \"expert\": %d, \"decode_us\": %.3f, \"dependency_us\": %.3f, "
                    "\"queued_us\": %.3f}}",
                    json_escape(kind_name(trace, event.kind)).c_str(), p,
                    static_cast<long long>(event.sm), (event.start_ns - begin) * 1e-3,
                    (event.end_ns - event.start_ns) * 1e-3, ticket, event.m_tile, event.n_tile,
                    event.expert, event.decode_ns * 1e-3, event.dependency_ns * 1e-3,
                    (event.start_ns - event.ready_ns) * 1e-3);
      file << buffer;
    }
  }
  file << "\n]}\n";
  if (!file) throw Error(ErrorCode::kInvalidArgument, "task trace: writing `" + path + "` failed");
}

}  // namespace mok
