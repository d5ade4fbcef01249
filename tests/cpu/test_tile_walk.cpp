// The standalone expert GEMM's tile walk (src/kernels/gemm/tile_walk.h): every output tile is
// produced by exactly one walk unit and CTA, alone or in CTA pairs; a pair's two tiles share
// their column tile (and expert), and only the second tile of an odd count is a phantom. And the
// 256 x 192 down GEMM's row units (src/kernels/gemm/wide_tile_walk.h): every schedule tile of
// the window in exactly one unit, a unit's tiles of one expert, paired from the expert's first
// tile in the window. And the groups of one expert's row tiles (expert_grouped_tile_in), and
// the FP8 GEMMs' 192-row tiles (src/kernels/gemm/fp8_rows192_walk.h).
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/gemm/fp8_rows192_walk.h"
#include "kernels/gemm/l2_placement.h"
#include "kernels/gemm/tile_walk.h"
#include "kernels/gemm/wide_tile_walk.h"

namespace mok::kernels {
namespace {

using Tile = std::tuple<int, int, int>;  // expert, m, n

void check_walk(int num_m_tiles, int num_n_tiles, int experts, bool row_tiles, bool paired,
                int group = kTileGroupM) {
  SCOPED_TRACE(testing::Message() << num_m_tiles << " x " << num_n_tiles << " tiles, " << experts
                                  << " experts, " << (row_tiles ? "row tiles" : "weight grads")
                                  << (paired ? ", pairs" : "") << ", groups of " << group);
  const int m_units = paired ? (num_m_tiles + 1) / 2 : num_m_tiles;
  const int units = m_units * num_n_tiles * (row_tiles ? 1 : experts);
  std::map<Tile, int> produced;
  int phantoms = 0;
  for (int unit = 0; unit < units; ++unit) {
    const WalkUnit walk = walk_unit(unit, m_units, num_n_tiles, row_tiles, group);
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
        for (int n = 1; n <= 7; n += 2)
          for (const int group : {1, 3, kTileGroupM, 64})
            check_walk(m, n, 3, row_tiles, paired, group);
}

// The group sets the order: consecutive units share a column tile within a group of row tiles,
// and a group of 1 walks one row tile's columns in turn.
TEST(TileWalk, GroupsSweepTheirColumnsTogether) {
  for (int unit = 0; unit < 12; ++unit) {
    const WalkUnit one = walk_unit(unit, 5, 4, true, 1);
    EXPECT_EQ(one.m_unit, unit / 4);
    EXPECT_EQ(one.n_tile, unit % 4);
    const WalkUnit three = walk_unit(unit, 5, 4, true, 3);
    EXPECT_EQ(three.m_unit, unit % 3);
    EXPECT_EQ(three.n_tile, unit / 3);
  }
  // The last group holds the remaining 2 row tiles.
  EXPECT_EQ(walk_unit(12, 5, 4, true, 3).m_unit, 3);
  EXPECT_EQ(walk_unit(13, 5, 4, true, 3).m_unit, 4);
  EXPECT_EQ(walk_unit(13, 5, 4, true, 3).n_tile, 0);
  EXPECT_EQ(walk_unit(14, 5, 4, true, 3).n_tile, 1);
}

// MoeConfig::gemm_expert_aligned_groups: on random experts of 1-12 row tiles, every tile once;
// groups sweep their columns together and start where an expert does whenever one starts within
// the reach of their place; an expert of at most reach + 1 tiles is never split; and where every
// place is an expert start the walk is the fixed groups'.
TEST(TileWalk, ExpertAlignedGroupsCoverEveryTileOnceAndSplitNoSmallExpert) {
  std::mt19937 rng(23);
  for (int trial = 0; trial < 300; ++trial) {
    const int max_tiles = trial % 3 == 0 ? 2 : trial % 3 == 1 ? 4 : 12;
    std::vector<int32_t> tile_expert;
    for (int expert = 0; tile_expert.size() < 40 + trial % 200; ++expert)
      tile_expert.insert(tile_expert.end(), 1 + rng() % max_tiles, expert);
    const int m_tiles = static_cast<int>(tile_expert.size());
    const int n_tiles = 1 + trial % 17;
    const int group = std::vector<int>{1, 2, 3, 5, kTileGroupM, 16}[trial % 6];
    SCOPED_TRACE(testing::Message() << m_tiles << " x " << n_tiles << " tiles, groups of " << group
                                    << ", experts of at most " << max_tiles);
    std::map<std::pair<int, int>, int> covered;
    std::vector<int> group_of_tile(m_tiles, -1);
    int current_group = -1;
    for (int unit = 0; unit < m_tiles * n_tiles; ++unit) {
      const WalkUnit w = walk_unit(unit, m_tiles, n_tiles, true, group, tile_expert.data());
      ASSERT_GE(w.m_unit, 0);
      ASSERT_LT(w.m_unit, m_tiles);
      ASSERT_LT(w.n_tile, n_tiles);
      ++covered[{w.m_unit, w.n_tile}];
      // The unit's group: the one holding row tile unit / n_tiles (tile_walk.h). Its units
      // are contiguous, so each row tile belongs to one group and the groups sweep in order.
      const int row = unit / n_tiles;
      int g = row / group;
      if (row < aligned_group_start(g, group, m_tiles, tile_expert.data())) --g;
      if (group_of_tile[w.m_unit] < 0) group_of_tile[w.m_unit] = g;
      EXPECT_EQ(group_of_tile[w.m_unit], g) << "row tile " << w.m_unit << " in two groups";
      EXPECT_GE(g, current_group) << "groups out of order at unit " << unit;
      current_group = g;
    }
    ASSERT_EQ(static_cast<int>(covered.size()), m_tiles * n_tiles);
    for (const auto& [tile, count] : covered) EXPECT_EQ(count, 1);
    // Groups are runs of row tiles, each starting at an expert start where one lies in reach.
    const int reach = std::min(group - 1, kGroupAlignReach);
    for (int g = 1; g * group < m_tiles; ++g) {
      const int start = aligned_group_start(g, group, m_tiles, tile_expert.data());
      ASSERT_GE(start, g * group);
      ASSERT_LT(start, std::min(g * group + std::max(reach, 1), m_tiles + 1));
      bool start_in_reach = false;  // the end of the tiles counts as one
      for (int t = g * group; t < g * group + reach; ++t)
        start_in_reach |= t >= m_tiles || tile_expert[t] != tile_expert[t - 1];
      if (start_in_reach) {
        EXPECT_TRUE(start == m_tiles || tile_expert[start] != tile_expert[start - 1])
            << "group " << g;
      } else {
        EXPECT_EQ(start, g * group) << "group " << g;
      }
    }
    if (max_tiles <= reach + 1)
      for (int t = 1; t < m_tiles; ++t)
        if (tile_expert[t] == tile_expert[t - 1])
          EXPECT_EQ(group_of_tile[t], group_of_tile[t - 1]) << "expert split at row tile " << t;
  }
  // One-tile experts: every place is an expert start, so the walk is the fixed groups'.
  std::vector<int32_t> singles(29);
  for (int t = 0; t < 29; ++t) singles[t] = t;
  for (int unit = 0; unit < 29 * 5; ++unit) {
    const WalkUnit fixed = walk_unit(unit, 29, 5, true, kTileGroupM);
    const WalkUnit aligned = walk_unit(unit, 29, 5, true, kTileGroupM, singles.data());
    EXPECT_EQ(fixed.m_unit, aligned.m_unit);
    EXPECT_EQ(fixed.n_tile, aligned.n_tile);
  }
}

// MoeConfig::gemm_expert_groups (expert_grouped_tile_in): on random experts of 0-40 row tiles
// (empty experts included) and random windows of them, the walk is the order written out here:
// expert by expert, each expert's tiles in the window split into ceil(tiles / most) runs that
// differ by one tile at most (the longer first), each run swept n-major with m fastest. So every
// tile of the window comes once, and no group holds two experts or more than `most` tiles.
TEST(TileWalk, ExpertGroupsWalkEachExpertInEvenRuns) {
  std::mt19937 rng(35);
  constexpr int32_t kRowAlign = 128;
  for (int trial = 0; trial < 400; ++trial) {
    const int max_tiles = std::vector<int>{3, 12, 40}[trial % 3];
    std::vector<int32_t> offsets{0}, tile_expert;
    for (int expert = 0; tile_expert.size() < 20 + trial % 150; ++expert) {
      const int tiles = rng() % 5 == 0 ? 0 : 1 + static_cast<int>(rng() % max_tiles);
      tile_expert.insert(tile_expert.end(), tiles, expert);
      offsets.push_back(static_cast<int32_t>(tile_expert.size()) * kRowAlign);
    }
    const int total = static_cast<int>(tile_expert.size());
    // The window: all the tiles, or a random run of them (a macrobatch's).
    const int base = trial % 2 == 0 ? 0 : static_cast<int>(rng() % total);
    const int m_tiles = trial % 2 == 0 ? total : 1 + static_cast<int>(rng() % (total - base));
    const int n_tiles = 1 + trial % 13;
    const int most = std::vector<int>{1, 2, 3, 7, 8, 16, 1024}[trial % 7];
    SCOPED_TRACE(testing::Message()
                 << "window [" << base << ", " << base + m_tiles << ") of " << total
                 << " row tiles, " << n_tiles << " column tiles, groups of at most " << most);
    std::vector<std::pair<int, int>> order;  // (m, n) relative to the window
    for (int first = 0; first < m_tiles;) {
      int end = first;
      while (end < m_tiles && tile_expert[base + end] == tile_expert[base + first]) ++end;
      const int count = end - first, groups = (count + most - 1) / most;
      for (int g = 0, row = first; g < groups; ++g) {
        const int size = count / groups + (g < count % groups ? 1 : 0);
        ASSERT_LE(size, most);
        for (int n = 0; n < n_tiles; ++n)
          for (int m = row; m < row + size; ++m) order.emplace_back(m, n);
        row += size;
      }
      first = end;
    }
    ASSERT_EQ(static_cast<int>(order.size()), m_tiles * n_tiles);
    for (int unit = 0; unit < m_tiles * n_tiles; ++unit) {
      int m = -1, n = -1;
      expert_grouped_tile_in(unit, base, m_tiles, n_tiles, most, tile_expert.data(), offsets.data(),
                             kRowAlign, &m, &n);
      ASSERT_EQ(m, order[unit].first) << "unit " << unit;
      ASSERT_EQ(n, order[unit].second) << "unit " << unit;
    }
  }
}

// The 192-row tiles: on random experts of 0-40 row tiles of 128 (empty experts included), with
// and without their routed counts (each in the last of its expert's 128-row tiles), the tiles
// cover exactly the chunks of 64 rows that the walk takes (every padded row without the counts,
// the chunks holding a routed row with them: each routed row once, a chunk of padding alone
// never), a tile's rows never leave its expert, each expert's tiles are ceil(chunks / 3) in row
// order, and only its last tiles are short: its last of 1 or 2 chunks, or its last two of 2
// where 3 + 1 would leave a lone chunk behind a full tile.
TEST(TileWalk, Rows192TilesCoverEachExpertsRowsOnce) {
  std::mt19937 rng(47);
  for (int trial = 0; trial < 600; ++trial) {
    const bool with_counts = trial % 2 != 0;
    const int experts = 1 + static_cast<int>(rng() % 300);
    const int max_tiles = std::vector<int>{2, 9, 40}[trial / 2 % 3];
    std::vector<int32_t> offsets{0}, counts, tile_start{0};
    for (int e = 0; e < experts; ++e) {
      const int tiles128 = rng() % 4 == 0 ? 0 : 1 + static_cast<int>(rng() % max_tiles);
      offsets.push_back(offsets.back() + tiles128 * 128);
      counts.push_back(tiles128 == 0 ? 0
                                     : (tiles128 - 1) * 128 + 1 + static_cast<int>(rng() % 128));
      const int32_t* given = with_counts ? counts.data() : nullptr;
      tile_start.push_back(tile_start.back() +
                           rows192_tiles(rows192_chunks(e, offsets.data(), given)));
    }
    SCOPED_TRACE(testing::Message() << experts << " experts, " << offsets.back() << " rows"
                                    << (with_counts ? ", routed counts" : ""));
    const int32_t* given = with_counts ? counts.data() : nullptr;
    std::vector<int> covered(offsets.back(), 0);
    int previous_expert = -1, previous_end = 0;
    for (int tile = 0; tile < tile_start.back(); ++tile) {
      const Rows192Tile t = rows192_tile(tile, tile_start.data(), experts, offsets.data(), given);
      ASSERT_GE(t.expert, 0);
      ASSERT_LT(t.expert, experts);
      ASSERT_GE(t.valid_chunks, 1);
      ASSERT_LE(t.valid_chunks, 3);
      const int end = t.row0 + t.valid_chunks * kRows192Chunk;
      const int expert_chunks = rows192_chunks(t.expert, offsets.data(), given);
      const int walked_end = offsets[t.expert] + expert_chunks * kRows192Chunk;
      ASSERT_GE(t.row0, offsets[t.expert]);
      ASSERT_LE(end, walked_end) << "tile " << tile << " leaves its expert's chunks";
      ASSERT_LE(walked_end, offsets[t.expert + 1]);
      // Short tiles end their expert: one of 1 or 2 chunks, or two of 2 where 3 + 1 would be.
      const int left = (walked_end - end) / kRows192Chunk;
      if (t.valid_chunks < 3) EXPECT_TRUE(left == 0 || (left == 2 && t.valid_chunks == 2)) << tile;
      if (expert_chunks >= 4) EXPECT_GE(t.valid_chunks, 2) << "a lone chunk behind a full tile";
      if (t.expert == previous_expert) EXPECT_EQ(t.row0, previous_end) << "tile " << tile;
      EXPECT_GE(t.expert, previous_expert) << "experts in order";
      for (int row = t.row0; row < end; ++row) ++covered[row];
      previous_expert = t.expert;
      previous_end = end;
    }
    for (int e = 0; e < experts; ++e) {
      const int routed_end = offsets[e] + (with_counts ? counts[e] : offsets[e + 1] - offsets[e]);
      const int walked_end = offsets[e] + rows192_chunks(e, offsets.data(), given) * kRows192Chunk;
      ASSERT_GE(walked_end, routed_end);
      ASSERT_LT(walked_end - routed_end, kRows192Chunk) << "expert " << e << ": a chunk of padding";
      for (int row = offsets[e]; row < offsets[e + 1]; ++row)
        ASSERT_EQ(covered[row], row < walked_end ? 1 : 0) << "expert " << e << ", row " << row;
    }
  }
}

// The L2 placement's walk (l2_placement.h): the slots of each partition cover their row tiles'
// units once, partition 0 the first row tiles in proportion to its slots, whatever the split of
// the slots and the group.
TEST(TileWalk, L2HalvesCoverEveryTileOnce) {
  for (const int grid : {2, 7, 132})
    for (const int lower : {1, grid / 2, grid - 1})
      for (const int m_units : {0, 1, 5, 33, 317})
        for (const int n_tiles : {1, 16}) {
          if (lower < 1 || lower >= grid) continue;
          SCOPED_TRACE(testing::Message() << "grid " << grid << ", lower " << lower << ", "
                                          << m_units << " x " << n_tiles << " tiles");
          std::map<std::pair<int, int>, int> covered;
          const int split = static_cast<int>((int64_t{m_units} * lower + grid / 2) / grid);
          for (int slot = 0; slot < grid; ++slot) {
            const CtaWalk walk = l2_half_walk(slot, grid, lower, m_units, n_tiles);
            EXPECT_EQ(walk.num_units, walk.m_units * n_tiles);
            for (int unit = walk.first; unit < walk.num_units; unit += walk.stride) {
              const WalkUnit w = walk_unit(unit, walk.m_units, n_tiles, true, 3);
              const int m = w.m_unit + walk.m_lo;
              EXPECT_EQ(m < split, slot < lower) << "row tile " << m << " in slot " << slot;
              ++covered[{m, w.n_tile}];
            }
          }
          EXPECT_EQ(static_cast<int>(covered.size()), m_units * n_tiles);
          for (const auto& [tile, count] : covered) EXPECT_EQ(count, 1);
        }
}

// Random segments (empty experts included) and macrobatch windows over them.
TEST(WideTileWalk, EveryWindowTileInOneUnitPairedWithinItsExpert) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 400; ++trial) {
    const int experts = 1 + static_cast<int>(rng() % 40);
    std::vector<int32_t> offsets(experts + 1, 0);
    for (int e = 0; e < experts; ++e)
      offsets[e + 1] = offsets[e] + kWideTileRows * static_cast<int32_t>(rng() % 8);
    const int32_t total_tiles = offsets[experts] / kWideTileRows;
    const int32_t m_begin = total_tiles > 0 ? static_cast<int32_t>(rng() % (total_tiles + 1)) : 0;
    const int32_t m_end = trial % 3 == 0
                              ? total_tiles
                              : m_begin + static_cast<int32_t>(rng() % (total_tiles - m_begin + 1));
    SCOPED_TRACE(testing::Message()
                 << "trial " << trial << ": " << experts << " experts, " << total_tiles
                 << " tiles, window [" << m_begin << ", " << m_end << ")");
    // The kernel's prefix (scan_row_units), written out plainly.
    std::vector<int32_t> unit_start(experts + 1, 0);
    for (int e = 0; e < experts; ++e) {
      int32_t first = 0, end = 0;
      expert_window_tiles(offsets.data(), e, m_begin, m_end, &first, &end);
      unit_start[e + 1] = unit_start[e] + wide_row_units(first, end);
    }
    std::vector<int> covered(total_tiles, 0);
    for (int32_t unit = 0; unit < unit_start[experts]; ++unit) {
      const WideRowUnit row_unit =
          wide_row_unit(unit, unit_start.data(), experts, offsets.data(), m_begin, m_end);
      ASSERT_GE(row_unit.expert, 0);
      ASSERT_LT(row_unit.expert, experts);
      ASSERT_TRUE(row_unit.num_tiles == 1 || row_unit.num_tiles == 2);
      int32_t first = 0, end = 0;
      expert_window_tiles(offsets.data(), row_unit.expert, m_begin, m_end, &first, &end);
      EXPECT_EQ((row_unit.m_tile - first) % 2, 0) << "pairs start at the expert's first tile";
      for (int t = 0; t < row_unit.num_tiles; ++t) {
        const int32_t tile = row_unit.m_tile + t;
        ASSERT_GE(tile, first);
        ASSERT_LT(tile, end) << "a unit's tiles are its expert's, inside the window";
        ++covered[tile];
      }
      if (row_unit.num_tiles == 1) EXPECT_EQ(row_unit.m_tile + 1, end) << "only a last tile alone";
    }
    for (int32_t tile = 0; tile < total_tiles; ++tile)
      EXPECT_EQ(covered[tile], tile >= m_begin && tile < m_end ? 1 : 0) << "tile " << tile;
  }
}

}  // namespace
}  // namespace mok::kernels
