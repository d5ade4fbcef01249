// The task-trace summary and Chrome trace (src/task_trace.cpp) on a hand-made trace whose
// numbers are known: two SMs, one idle gap, one wait for the scheduler, and a ticket that
// recorded nothing.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "mok/error.h"
#include "mok/task_trace.h"

namespace {

mok::TaskTraceEvent event(int32_t kind, int32_t sm, uint64_t ticket, uint64_t ready, uint64_t start,
                          uint64_t end) {
  mok::TaskTraceEvent e{};
  e.ticket_ns = ticket;
  e.ready_ns = ready;
  e.start_ns = start;
  e.end_ns = end;
  e.kind = kind;
  e.sm = sm;
  e.m_tile = 1;
  e.n_tile = 2;
  e.expert = 3;
  return e;
}

// The whitespace-separated fields of `line` after `marker`.
std::vector<std::string> fields_after(const std::string& line, const std::string& marker) {
  std::istringstream rest(line.substr(line.find(marker) + marker.size()));
  std::vector<std::string> fields;
  for (std::string field; rest >> field;) fields.push_back(field);
  return fields;
}

mok::TaskTraceEvent empty_event() {
  mok::TaskTraceEvent e;
  std::memset(&e, 0xff, sizeof e);
  return e;
}

mok::TaskTrace sample_trace() {
  mok::TaskTrace trace;
  trace.kernel = "test kernel";
  trace.kind_names = {"gemm", "swiglu"};
  // Times in ns from 1000: SM 0 runs gemm [1000, 3000), waits, gemm [5000, 9000) after a
  // 2000 ns wait for the scheduler (1000 ns decoding, 1000 ns for the dependency); SM 1 runs
  // swiglu [1000, 11000). Span: 1000 .. 11000.
  trace.events = {event(0, 0, 1000, 1000, 1000, 3000), empty_event(),
                  event(0, 0, 3000, 5000, 5000, 9000), event(1, 1, 1000, 1000, 1000, 11000)};
  trace.events[2].decode_ns = 1000;
  trace.events[2].dependency_ns = 1000;
  return trace;
}

TEST(TaskTrace, SummaryCountsBusyIdleAndWaits) {
  const std::string summary = mok::summarize_task_trace(sample_trace());
  // Consumer busy: 2000 + 4000 + 10000 ns of 2 SMs x 10000 ns span = 80%.
  EXPECT_NE(summary.find("test kernel: 3 tasks on 2 SMs, span 0.010 ms, consumer warps busy 80.0%"),
            std::string::npos)
      << summary;
  std::istringstream lines(summary);
  std::string line;
  bool saw_gemm = false, saw_swiglu = false;
  while (std::getline(lines, line)) {
    if (line.find("  gemm ") != std::string::npos) {
      saw_gemm = true;
      // 2 tasks, mean 3 us, busy 6000 ns / 2 SMs = 0.003 ms, mean decode 0.5 us and dependency
      // wait 0.5 us (the second: 1000 ns of each), idle before: the 2000 ns gap / 2 SMs.
      EXPECT_EQ(fields_after(line, "gemm"),
                (std::vector<std::string>{"2", "3.00", "0.003", "0.50", "0.50", "0.001"}))
          << line;
    }
    if (line.find("  swiglu ") != std::string::npos) {
      saw_swiglu = true;
      EXPECT_EQ(fields_after(line, "swiglu").at(1), "10.00") << line;
    }
  }
  EXPECT_TRUE(saw_gemm) << summary;
  EXPECT_TRUE(saw_swiglu) << summary;
  // SM 0 ends at 9000, SM 1 at 11000: 2000 ns after the last task over 2 SMs.
  EXPECT_NE(summary.find("0.000 ms before its first task, 0.001 ms after its last"),
            std::string::npos)
      << summary;
}

TEST(TaskTrace, EmptyTraceSaysSo) {
  mok::TaskTrace trace;
  trace.kernel = "nothing";
  trace.events = {empty_event(), empty_event()};
  EXPECT_EQ(mok::summarize_task_trace(trace), "nothing: no tasks recorded\n");
}

TEST(TaskTrace, ChromeTraceHasOneSlicePerRecordedTask) {
  const std::string path = ::testing::TempDir() + "mok_task_trace_test.json";
  mok::write_chrome_trace({sample_trace()}, path);
  std::ifstream file(path);
  std::stringstream text;
  text << file.rdbuf();
  const std::string json = text.str();
  size_t slices = 0;
  for (size_t at = json.find("\"ph\": \"X\""); at != std::string::npos;
       at = json.find("\"ph\": \"X\"", at + 1))
    ++slices;
  EXPECT_EQ(slices, 3u);
  EXPECT_NE(json.find("\"name\": \"test kernel\""), std::string::npos);
  EXPECT_NE(json.find("\"tid\": 1"), std::string::npos);  // SM 1
  EXPECT_NE(json.find("\"decode_us\": 1.000, \"dependency_us\": 1.000"), std::string::npos);
  std::remove(path.c_str());
}

TEST(TaskTrace, UnwritablePathIsAnError) {
  try {
    mok::write_chrome_trace({sample_trace()}, "/nonexistent-dir/trace.json");
    FAIL() << "expected mok::Error";
  } catch (const mok::Error& error) {
    EXPECT_NE(std::string(error.what()).find("/nonexistent-dir/trace.json"), std::string::npos);
  }
}

}  // namespace
