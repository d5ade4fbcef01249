// The L2 partition clustering (src/testing/l2_partitions.cpp) on made-up latencies: two
// partitions of unequal size with noisy near and far latencies are recovered exactly (SM 0's
// partition called 0), and latencies without that structure are reported as unclear.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "layer/l2_partitions.h"
#include "mok/error.h"

namespace mok {
namespace {

TEST(L2Partitions, TwoNoisyPartitionsAreRecovered) {
  std::mt19937 rng(17);
  const int32_t sms = 132;
  std::vector<int32_t> ids(sms), truth(sms);
  for (int32_t s = 0; s < sms; ++s) {
    ids[s] = 2 * s + (s % 3);  // ids need not be dense
    truth[s] = (s * 7 + 3) % 13 < 6 ? 1 : 0;
  }
  std::vector<int32_t> home(kL2ProbeLines);
  for (int32_t& h : home) h = static_cast<int32_t>(rng() % 2);
  std::uniform_int_distribution<int> noise(0, 60);
  std::vector<uint32_t> latency(static_cast<size_t>(sms) * kL2ProbeLines);
  for (int32_t s = 0; s < sms; ++s)
    for (int32_t line = 0; line < kL2ProbeLines; ++line)
      latency[s * kL2ProbeLines + line] = 300 + (home[line] != truth[s] ? 180 : 0) + noise(rng);
  const L2PartitionMap map = cluster_l2_partitions(ids, latency);
  EXPECT_TRUE(map.clear) << map.describe();
  int32_t in_truth[2] = {0, 0};
  for (int32_t s = 0; s < sms; ++s) {
    EXPECT_EQ(map.partition[s], truth[s] == truth[0] ? 0 : 1) << "SM " << ids[s];
    ++in_truth[truth[s] == truth[0] ? 0 : 1];
  }
  EXPECT_EQ(map.sms_in[0], in_truth[0]);
  EXPECT_EQ(map.sms_in[1], in_truth[1]);
  EXPECT_EQ(map.min_agreement, kL2ProbeLines);
  EXPECT_LT(map.near_cycles, 380);
  EXPECT_GT(map.far_cycles, 470);
  EXPECT_NE(map.describe().find("partition 0's SM ids: " + std::to_string(ids[0])),
            std::string::npos);
}

TEST(L2Partitions, LatenciesWithoutStructureAreUnclear) {
  std::mt19937 rng(5);
  const int32_t sms = 64;
  std::vector<int32_t> ids(sms);
  for (int32_t s = 0; s < sms; ++s) ids[s] = s;
  std::uniform_int_distribution<int> latency_of(300, 480);
  std::vector<uint32_t> latency(static_cast<size_t>(sms) * kL2ProbeLines);
  for (uint32_t& value : latency) value = static_cast<uint32_t>(latency_of(rng));
  const L2PartitionMap map = cluster_l2_partitions(ids, latency);
  EXPECT_FALSE(map.clear) << map.describe();
  EXPECT_NE(map.describe().find("no clear L2 partitions"), std::string::npos);
}

TEST(L2Partitions, SlotTableOrdersEachPartitionById) {
  L2PartitionMap map;
  map.clear = true;
  map.sm_ids = {7, 2, 9, 4, 0};
  map.partition = {0, 1, 0, 1, 0};
  map.sms_in[0] = 3;
  map.sms_in[1] = 2;
  const L2SlotTable table = l2_slot_table(map);
  ASSERT_EQ(table.slot_of_sm.size(), 10u);
  EXPECT_EQ(table.lower_slots, 3);
  // Partition 0: ids 0, 7, 9 -> slots 0, 1, 2; partition 1: ids 2, 4 -> 3, 4.
  const std::vector<int32_t> want = {0, -1, 3, -1, 4, -1, -1, 1, -1, 2};
  EXPECT_EQ(table.slot_of_sm, want);
  L2PartitionMap unclear = map;
  unclear.clear = false;
  EXPECT_TRUE(l2_slot_table(unclear).slot_of_sm.empty());
  L2PartitionMap twice = map;
  twice.sm_ids = {7, 2, 9, 4, 7};  // an SM probed twice (two CTAs shared it)
  EXPECT_TRUE(l2_slot_table(twice).slot_of_sm.empty());
}

TEST(L2Partitions, RejectsMismatchedSizes) {
  EXPECT_THROW(cluster_l2_partitions({0, 1}, std::vector<uint32_t>(10)), Error);
  EXPECT_THROW(cluster_l2_partitions({0}, std::vector<uint32_t>(kL2ProbeLines)), Error);
}

}  // namespace
}  // namespace mok
