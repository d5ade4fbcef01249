// `mok stream-bench` counts bytes it must really move: each of its access patterns and ring
// depths, on a tensor whose words are a hash of their index, must land every word in shared
// memory exactly once per reader (the benchmark runs the same check before it times anything).
#include <gtest/gtest.h>

#include "mok/testing/stream_bench.h"

namespace mok {
namespace {

TEST(StreamBenchGpu, EveryPatternLandsEachWordOncePerReader) {
  EXPECT_EQ(stream_bench_self_check(), "");
}

}  // namespace
}  // namespace mok
