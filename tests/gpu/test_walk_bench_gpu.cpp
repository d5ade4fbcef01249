// `mok walk-bench` on a small shape: every walk of both forms runs to its end, so each unit's
// armed bytes match what its boxes bring (a mismatch leaves a stage unfilled, and the consumer's
// wait times out with a diagnosis), column tiles clipped at N included (I = 320 ends gate/up in
// a 32-column tile, H = 448 the down GEMM in a 64-column one).
#include <gtest/gtest.h>

#include "mok/testing/walk_bench.h"
#include "test_util.h"

namespace mok {
namespace {

TEST(WalkBenchGpu, EveryWalkRunsOnASmallShape) {
  const MoeShape shape = test::make_shape(600, 448, 320, 8, 4);
  EXPECT_EQ(run_walk_bench(shape, RoutingKind::kSkewed, 3, /*once=*/true), 0);
}

}  // namespace
}  // namespace mok
