// The task-trace summary and Chrome trace (src/task_trace.cpp) on a hand-made trace whose
// numbers are known: two SMs, one idle gap, one dependency wait, one spare-warp task, and
// tickets that recorded nothing.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "mok/error.h"
#include "mok/task_trace.h"

namespace {

mok::TaskTraceEvent event(int32_t kind, int32_t sm, uint64_t ticket, uint64_t ready, uint64_t start,
                          uint64_t end, int32_t runner = 0) {
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
  e.unused[0] = runner;
  return e;
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
  // 2000 ns dependency wait; SM 1 runs swiglu [1000, 11000) on its consumers and a swiglu task
  // on its spare warps [2000, 4000). Span: 1000 .. 11000.
  trace.events = {event(0, 0, 1000, 1000, 1000, 3000), empty_event(),
                  event(0, 0, 3000, 5000, 5000, 9000), event(1, 1, 1000, 1000, 1000, 11000),
                  event(1, 1, 1500, 2000, 2000, 4000, 1)};
  return trace;
}

TEST(TaskTrace, SummaryCountsBusyIdleAndWaits) {
  const std::string summary = mok::summarize_task_trace(sample_trace());
  // Consumer busy: 2000 + 4000 + 10000 ns of 2 SMs x 10000 ns span = 80%.
  EXPECT_NE(summary.find("test kernel: 4 tasks on 2 SMs, span 0.010 ms, consumer warps busy 80.0%"),
            std::string::npos)
      << summary;
  std::istringstream lines(summary);
  std::string line;
  bool saw_gemm = false, saw_spare = false;
  while (std::getline(lines, line)) {
    if (line.find("gemm (consumers)") != std::string::npos) {
      saw_gemm = true;
      // 2 tasks, mean 3 us, busy 6000 ns / 2 SMs = 0.003 ms, mean dependency wait 1 us, idle
      // before: the 2000 ns gap / 2 SMs = 0.001 ms.
      EXPECT_NE(line.find("2      3.00          0.003           1.00            0.001"),
                std::string::npos)
          << line;
    }
    if (line.find("swiglu (spare warps)") != std::string::npos) {
      saw_spare = true;
      EXPECT_NE(line.find("1      2.00"), std::string::npos) << line;
    }
  }
  EXPECT_TRUE(saw_gemm) << summary;
  EXPECT_TRUE(saw_spare) << summary;
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
  EXPECT_EQ(slices, 4u);
  EXPECT_NE(json.find("\"name\": \"test kernel\""), std::string::npos);
  EXPECT_NE(json.find("\"tid\": 1001"), std::string::npos);  // the spare-warp task's thread
  EXPECT_NE(json.find("\"dependency_us\": 2.000"), std::string::npos);
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
