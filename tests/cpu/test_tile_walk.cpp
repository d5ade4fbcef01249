// The standalone expert GEMM's tile walk (src/kernels/gemm/tile_walk.h): every output tile is
// produced by exactly one walk unit and CTA, alone or in CTA pairs; a pair's two tiles share
// their column tile (and expert), and only the second tile of an odd count is a phantom.
#include <gtest/gtest.h>

#include <map>
#include <tuple>

#include "kernels/gemm/tile_walk.h"

namespace mok::kernels {
namespace {

using Tile = std::tuple<int, int, int>;  // expert, m, n

void check_walk(int num_m_tiles, int num_n_tiles, int experts, bool row_tiles, bool paired) {
  SCOPED_TRACE(testing::Message() << num_m_tiles << " x " << num_n_tiles << " tiles, " << experts
                                  << " experts, " << (row_tiles ? "row tiles" : "weight grads")
                                  << (paired ? ", pairs" : ""));
  const int m_units = paired ? (num_m_tiles + 1) / 2 : num_m_tiles;
  const int units = m_units * num_n_tiles * (row_tiles ? 1 : experts);
  std::map<Tile, int> produced;
  int phantoms = 0;
  for (int unit = 0; unit < units; ++unit) {
    const WalkUnit walk = walk_unit(unit, m_units, num_n_tiles, row_tiles);
    ASSERT_LT(walk.m_unit, m_units);
    ASSERT_LT(walk.n_tile, num_n_tiles);
    ASSERT_LT(walk.expert, row_tiles ? 1 : experts);
    if (!paired) {
      ++produced[{walk.expert, walk.m_unit, walk.n_tile}];
      continue;
    }
    for (int rank = 0; rank < 2; ++rank) {
      const PairRow row = pair_row(walk.m_unit, rank, num_m_tiles);
      ASSERT_LT(row.m_tile, num_m_tiles);
      EXPECT_EQ(row.m_tile / 2, walk.m_unit) << "a pair's tiles are neighbours";
      if (row.phantom) {
        ++phantoms;
        EXPECT_EQ(rank, 1);
        EXPECT_FALSE(row.partner_exists);
        continue;
      }
      ++produced[{walk.expert, row.m_tile, walk.n_tile}];
    }
  }
  EXPECT_EQ(static_cast<int>(produced.size()),
            num_m_tiles * num_n_tiles * (row_tiles ? 1 : experts));
  for (const auto& [tile, count] : produced) EXPECT_EQ(count, 1) << "tile produced twice";
  const int expected_phantoms =
      paired && num_m_tiles % 2 == 1 ? num_n_tiles * (row_tiles ? 1 : experts) : 0;
  EXPECT_EQ(phantoms, expected_phantoms);
}

TEST(TileWalk, EveryTileOnceAloneAndInPairs) {
  for (const bool row_tiles : {true, false})
    for (const bool paired : {false, true})
      for (int m = 1; m <= 19; m += 3)
        for (int n = 1; n <= 7; n += 2) check_walk(m, n, 3, row_tiles, paired);
}

}  // namespace
}  // namespace mok::kernels
