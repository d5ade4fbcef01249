// `mok walk-bench` on a small shape, and its L2 partition probe: every walk of both forms runs to
// its end, so each unit's armed bytes match what its boxes bring (a mismatch leaves a stage
// unfilled, and the consumer's wait times out with a diagnosis), column tiles clipped at N included
// (I = 320 ends gate/up in a 32-column tile, H = 448 the down GEMM in a 64-column one). The
// fabric probe's launches run where the partitions are found.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "layer/l2_partitions.h"
#include "mok/error.h"
#include "mok/testing/walk_bench.h"
#include "test_util.h"

namespace mok {
namespace {

// The L2 partition probe times every SM once (whether the latencies show two partitions is
// what it measures, so that is printed, not asserted).
TEST(WalkBenchGpu, L2ProbeTimesEverySmOnce) {
  int sms = 0, device = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), cudaSuccess);
  const L2PartitionMap map = probe_l2_partitions(sms);
  std::printf("  %s\n", map.describe().c_str());
  std::vector<int32_t> ids = map.sm_ids;
  ASSERT_EQ(static_cast<int>(ids.size()), sms);
  std::sort(ids.begin(), ids.end());
  EXPECT_EQ(std::adjacent_find(ids.begin(), ids.end()), ids.end()) << "an SM probed twice";
  EXPECT_EQ(map.sms_in[0] + map.sms_in[1], sms);
  EXPECT_GT(map.near_cycles, 0);
}

TEST(WalkBenchGpu, EveryWalkRunsOnASmallShape) {
  const MoeShape shape = test::make_shape(600, 448, 320, 8, 4);
  WalkBenchOptions once;
  once.once = true;
  EXPECT_EQ(run_walk_bench(shape, RoutingKind::kSkewed, 3, once), 0);
}

// The pace sweep's every ring (3-6 stages, K-blocks of 64 and 32, one operand, fewer CTAs, the
// stages held 0-2, the epilogues) runs to the end: each fits the ring's memory and none hangs.
TEST(WalkBenchGpu, PaceSweepRunsOnASmallShape) {
  const MoeShape shape = test::make_shape(600, 448, 320, 8, 4);
  WalkBenchOptions sweep;
  sweep.pace_sweep = true;
  EXPECT_EQ(run_walk_bench(shape, RoutingKind::kSkewed, 3, sweep), 0);
}

// The fabric probe runs its three launches where the L2 probe finds two partitions, and says so
// where it does not.
TEST(WalkBenchGpu, FabricProbeRunsWhereThePartitionsAreFound) {
  const MoeShape shape = test::make_shape(600, 448, 320, 8, 4);
  WalkBenchOptions probe;
  probe.once = true;
  probe.fabric_probe = true;
  try {
    EXPECT_EQ(run_walk_bench(shape, RoutingKind::kSkewed, 3, probe), 0);
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kUnsupported) << error.what();
    EXPECT_NE(std::string(error.what()).find("no clear partitions"), std::string::npos);
  }
}

}  // namespace
}  // namespace mok
