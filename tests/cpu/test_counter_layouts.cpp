// The device counter buffers' layouts (kernels/common/counter_layouts.h): every region lies
// inside its buffer and no two overlap, for shapes with and without a shared expert; the
// buffer sizes are the ones the layer allocated before the layouts existed.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/common/counter_layouts.h"

namespace mok {
namespace {

struct Region {
  const char* name;
  int64_t begin, words;
};

// Every region in [0, total), none sharing a word with another.
void expect_disjoint_within(std::vector<Region> regions, int64_t total) {
  std::sort(regions.begin(), regions.end(),
            [](const Region& a, const Region& b) { return a.begin < b.begin; });
  int64_t end = 0;
  for (const Region& region : regions) {
    EXPECT_GE(region.begin, end) << region.name << " overlaps the region before it";
    EXPECT_GE(region.words, 0) << region.name;
    end = region.begin + region.words;
    EXPECT_LE(end, total) << region.name << " ends past the buffer";
  }
}

TEST(CounterLayouts, GatherForwardAndBackwardRegionsAreDisjoint) {
  for (const auto& [max_tiles, experts, shared_tiles] :
       std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {1, 1, 0}, {274, 32, 32}, {8200, 256, 0}, {37, 5, 3}}) {
    SCOPED_TRACE("max_tiles " + std::to_string(max_tiles) + ", experts " + std::to_string(experts) +
                 ", shared tiles " + std::to_string(shared_tiles));
    const kernels::GatherCounterLayout gather{max_tiles};
    expect_disjoint_within({{"ticket", gather.ticket(), 1},
                            {"epoch", gather.epoch(), 1},
                            {"tile rows", gather.tile_rows_done(), max_tiles}},
                           gather.words());
    EXPECT_EQ(gather.words(), 2 + max_tiles);

    const kernels::ForwardCounterLayout forward{max_tiles, shared_tiles};
    expect_disjoint_within({{"ticket", forward.ticket(), 1},
                            {"epoch", forward.epoch(), 1},
                            {"gate/up done", forward.gate_up_done(), max_tiles},
                            {"shared gate/up done", forward.shared_gate_up_done(), shared_tiles}},
                           forward.words());
    EXPECT_EQ(forward.words(), 2 + max_tiles + shared_tiles);

    const kernels::BackwardCounterLayout backward{max_tiles, experts, shared_tiles};
    expect_disjoint_within(
        {{"ticket", backward.ticket(), 1},
         {"epoch", backward.epoch(), 1},
         {"row GEMMs done", backward.row_gemms_done(), max_tiles},
         {"SwiGLU done", backward.swiglu_done(), max_tiles},
         {"expert ready", backward.expert_ready(), experts},
         {"d_out gather", backward.d_out_gather(), backward.gather().words()},
         {"x gather", backward.x_gather(), backward.gather().words()},
         {"shared row GEMMs done", backward.shared_row_gemms_done(), shared_tiles},
         {"shared SwiGLU done", backward.shared_swiglu_done(), shared_tiles},
         {"shared expert ready", backward.shared_expert_ready(), 1}},
        backward.words());
    EXPECT_EQ(backward.words(),
              2 + 2 * max_tiles + experts + 2 * (2 + max_tiles) + 2 * shared_tiles + 1);
  }
}

TEST(CounterLayouts, EpCountersPairEachBarriersEpochWithItsCount) {
  // push_rows_args reads a barrier's epoch at its pointer and its CTA count one word after.
  EXPECT_EQ(static_cast<int>(kernels::EpCounter::kPushDone),
            static_cast<int>(kernels::EpCounter::kPushEpoch) + 1);
  EXPECT_EQ(static_cast<int>(kernels::EpCounter::kDispatchDone),
            static_cast<int>(kernels::EpCounter::kDispatchEpoch) + 1);
  EXPECT_EQ(static_cast<int>(kernels::EpCounter::kCount), 5);
}

}  // namespace
}  // namespace mok
