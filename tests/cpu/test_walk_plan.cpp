// The walks `mok walk-bench` replays (src/testing/walk_plan.cpp): the expert GEMM's and the
// 256 x 192 tiles' walks are the kernels' own (tile_walk.h, wide_tile_walk.h, unit for unit),
// every walk covers each (row tile, column) exactly once, and the bytes it asks for.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/gemm/tile_walk.h"
#include "kernels/gemm/wide_tile_walk.h"
#include "mok/error.h"
#include "mok/shape.h"
#include "mok/testing/walk_bench.h"

namespace mok {
namespace {

std::vector<int32_t> random_tiles(std::mt19937& rng, int experts) {
  std::uniform_int_distribution<int> tiles(1, 5);
  std::vector<int32_t> out(experts);
  for (int32_t& t : out) t = tiles(rng);
  return out;
}

std::vector<int32_t> segment_starts(const std::vector<int32_t>& tiles) {
  std::vector<int32_t> offsets(1, 0);
  for (const int32_t t : tiles) offsets.push_back(offsets.back() + t * 128);
  return offsets;
}

TEST(WalkPlan, ExpertGemmWalkIsTheKernels) {
  std::mt19937 rng(7);
  for (int round = 0; round < 8; ++round) {
    const std::vector<int32_t> tiles = random_tiles(rng, 3 + round * 5);
    const std::vector<int32_t> offsets = segment_starts(tiles);
    const int32_t m_tiles = offsets.back() / 128;
    const int64_t n_extent = 768 + 64 * round;  // I (gate/up: 128 columns a tile)
    const std::vector<WalkLoad> loads =
        plan_walk({"expert GEMM", 128, 256, 8}, WalkForm::kGateUp, tiles, n_extent);
    const int32_t n_tiles = static_cast<int32_t>((n_extent + 127) / 128);
    ASSERT_EQ(loads.size(), static_cast<size_t>(m_tiles) * n_tiles);
    for (int32_t unit = 0; unit < static_cast<int32_t>(loads.size()); ++unit) {
      const kernels::WalkUnit walk = kernels::walk_unit(unit, m_tiles, n_tiles, true);
      int32_t expert = 0;
      while (offsets[expert + 1] <= walk.m_unit * 128) ++expert;
      EXPECT_EQ(loads[unit].a_row, walk.m_unit * 128) << "unit " << unit;
      EXPECT_EQ(loads[unit].a_boxes, 1);
      EXPECT_EQ(loads[unit].expert, expert) << "unit " << unit;
      EXPECT_EQ(loads[unit].n0, walk.n_tile * 128) << "unit " << unit;
    }
  }
}

TEST(WalkPlan, WideTileWalkIsTheKernels) {
  std::mt19937 rng(11);
  for (int round = 0; round < 8; ++round) {
    const std::vector<int32_t> tiles = random_tiles(rng, 2 + round * 7);
    const std::vector<int32_t> offsets = segment_starts(tiles);
    const int32_t experts = static_cast<int32_t>(tiles.size());
    const int32_t m_tiles = offsets.back() / 128;
    std::vector<int32_t> unit_start(experts + 1, 0);
    for (int32_t e = 0; e < experts; ++e) {
      int32_t first = 0, end = 0;
      kernels::expert_window_tiles(offsets.data(), e, 0, m_tiles, &first, &end);
      unit_start[e + 1] = unit_start[e] + kernels::wide_row_units(first, end);
    }
    const int64_t n_extent = 1024 + 448 * round;  // H (down: 192 columns a tile)
    const std::vector<WalkLoad> loads =
        plan_walk({"256 x 192", 256, 192, 8}, WalkForm::kDown, tiles, n_extent);
    const int32_t n_tiles = static_cast<int32_t>((n_extent + 191) / 192);
    ASSERT_EQ(loads.size(), static_cast<size_t>(unit_start[experts]) * n_tiles);
    for (int32_t unit = 0; unit < static_cast<int32_t>(loads.size()); ++unit) {
      int32_t row_unit = 0, n_tile = 0;
      kernels::grouped_tile(unit, unit_start[experts], n_tiles, &row_unit, &n_tile);
      const kernels::WideRowUnit rows =
          kernels::wide_row_unit(row_unit, unit_start.data(), experts, offsets.data(), 0, m_tiles);
      EXPECT_EQ(loads[unit].a_row, rows.m_tile * 128) << "unit " << unit;
      EXPECT_EQ(loads[unit].a_boxes, rows.num_tiles) << "unit " << unit;
      EXPECT_EQ(loads[unit].expert, rows.expert) << "unit " << unit;
      EXPECT_EQ(loads[unit].n0, n_tile * 192) << "unit " << unit;
    }
  }
}

TEST(WalkPlan, EveryWalkCoversEachTileOnce) {
  std::mt19937 rng(5);
  const std::vector<int32_t> tiles = random_tiles(rng, 13);
  const std::vector<int32_t> offsets = segment_starts(tiles);
  for (const WalkSpec& spec : std::vector<WalkSpec>{{"a", 128, 256, 1},
                                                    {"b", 128, 192, 3},
                                                    {"c", 256, 192, 2},
                                                    {"d", 256, 256, 32},
                                                    {"e", 128, 64, 8},
                                                    {"f", 256, 192, 4, true}}) {
    for (const WalkForm form : {WalkForm::kGateUp, WalkForm::kDown}) {
      SCOPED_TRACE(testing::Message() << spec.tile_rows << " x " << spec.tile_n << ", groups of "
                                      << spec.group << (form == WalkForm::kDown ? ", down" : ""));
      const int64_t n_extent = 1000;
      const int32_t columns = form == WalkForm::kGateUp ? spec.tile_n / 2 : spec.tile_n;
      std::map<std::pair<int32_t, int32_t>, int> covered;  // (row tile, column tile)
      for (const WalkLoad& load : plan_walk(spec, form, tiles, n_extent)) {
        ASSERT_EQ(load.n0 % columns, 0);
        for (int32_t box = 0; box < load.a_boxes; ++box) {
          const int32_t row = load.a_row + 128 * box;
          EXPECT_GE(row, offsets[load.expert]);
          EXPECT_LT(row, offsets[load.expert + 1]) << "a unit's rows are its expert's";
          ++covered[{row / 128, load.n0 / columns}];
        }
      }
      const int32_t n_tiles = static_cast<int32_t>((n_extent + columns - 1) / columns);
      EXPECT_EQ(covered.size(), static_cast<size_t>(offsets.back() / 128) * n_tiles);
      for (const auto& [tile, count] : covered) EXPECT_EQ(count, 1);
    }
  }
}

TEST(WalkPlan, AskedBytesCountTheBoxesInsideN) {
  // Two experts of 3 and 1 tiles; 256 x 192 down over H = 320 (K = 64): units (0,1), (2), (3)
  // times column tiles [0, 192) and [192, 320) (128 rows inside N).
  const std::vector<int32_t> tiles = {3, 1};
  const WalkSpec spec{"256 x 192", 256, 192, 8};
  const std::vector<WalkLoad> loads = plan_walk(spec, WalkForm::kDown, tiles, 320);
  ASSERT_EQ(loads.size(), 6u);
  const int64_t row = 64 * 2;
  const int64_t a = (2 + 1 + 1) * 128 * row * 2;  // each row unit under both column tiles
  const int64_t b = 3 * (192 + 128) * row;
  EXPECT_EQ(walk_asked_bytes(spec, WalkForm::kDown, loads, 320, 64), a + b);
  // Gate/up asks for the gate and the up rows: 96 + 96 per column tile of 96.
  const WalkSpec gate_up{"256 x 192", 256, 192, 8};
  const std::vector<WalkLoad> gu = plan_walk(gate_up, WalkForm::kGateUp, tiles, 96);
  EXPECT_EQ(walk_asked_bytes(gate_up, WalkForm::kGateUp, gu, 96, 64),
            (2 + 1 + 1) * 128 * row + 3 * 2 * 96 * row);
}

TEST(WalkPlan, LoneTilesLastFollowEveryPair) {
  const std::vector<int32_t> tiles = {3, 2, 1, 5};  // units: pair+lone, pair, lone, 2 pairs+lone
  WalkSpec spec{"256 x 192", 256, 192, 1, true};
  const std::vector<WalkLoad> loads = plan_walk(spec, WalkForm::kDown, tiles, 192);
  ASSERT_EQ(loads.size(), 7u);                                    // one column tile
  const std::vector<int32_t> want_rows = {0, 3, 6, 8, 2, 5, 10};  // in schedule tiles
  for (size_t u = 0; u < loads.size(); ++u) {
    EXPECT_EQ(loads[u].a_row, want_rows[u] * 128) << "unit " << u;
    EXPECT_EQ(loads[u].a_boxes, u < 4 ? 2 : 1) << "unit " << u;
  }
}

TEST(WalkPlan, WaveUniqueBytesCountEachBoxOncePerWave) {
  // Expert 0 of 2 tiles, expert 1 of 1; 128 x 256 down over H = 512 (2 column tiles), K = 64:
  // units in order (m0,n0) (m1,n0) (m2,n0) (m0,n1) (m1,n1) (m2,n1).
  const std::vector<int32_t> tiles = {2, 1};
  const WalkSpec spec{"128 x 256", 128, 256, 8};
  const std::vector<WalkLoad> loads = plan_walk(spec, WalkForm::kDown, tiles, 512);
  ASSERT_EQ(loads.size(), 6u);
  const int64_t box = 128 * 64 * 2, b_tile = 256 * 64 * 2;
  // One wave of all six: 3 A boxes, 4 B tiles (2 experts x 2 columns).
  EXPECT_EQ(walk_wave_unique_bytes(spec, WalkForm::kDown, loads, 512, 64, 6), 3 * box + 4 * b_tile);
  // Waves of three: each holds the 3 A boxes and 2 B tiles (expert 0's and 1's at one column).
  EXPECT_EQ(walk_wave_unique_bytes(spec, WalkForm::kDown, loads, 512, 64, 3),
            2 * (3 * box + 2 * b_tile));
  // Waves of one: what the units ask for.
  EXPECT_EQ(walk_wave_unique_bytes(spec, WalkForm::kDown, loads, 512, 64, 1),
            walk_asked_bytes(spec, WalkForm::kDown, loads, 512, 64));
  EXPECT_THROW(walk_wave_unique_bytes(spec, WalkForm::kDown, loads, 512, 64, 0), Error);
}

TEST(WalkPlan, ExpertHalvesKeepEachSlotOnOneHalf) {
  std::mt19937 rng(3);
  const std::vector<int32_t> tiles = random_tiles(rng, 10);
  const WalkSpec spec{"128 x 256", 128, 256, 8};
  const std::vector<WalkLoad> loads = plan_walk(spec, WalkForm::kDown, tiles, 1024);
  struct Case {
    int32_t grid;
    bool parity;
    int32_t lower_slots;  // -1: the default
  };
  for (const Case c :
       {Case{6, false, -1}, Case{7, false, -1}, Case{132, false, -1}, Case{7, true, -1},
        Case{132, true, -1}, Case{132, false, 64}, Case{9, false, 2}}) {
    SCOPED_TRACE(testing::Message() << "grid " << c.grid << (c.parity ? ", parity" : ", halves")
                                    << ", lower slots " << c.lower_slots);
    const int32_t lower =
        c.lower_slots >= 0 ? c.lower_slots : (c.parity ? (c.grid + 1) / 2 : c.grid / 2);
    const int32_t split = (10 * lower + c.grid / 2) / c.grid;  // experts below it: the first half
    const std::vector<WalkLoad> placed =
        place_by_expert_halves(loads, 10, c.grid, c.parity, c.lower_slots);
    ASSERT_EQ(placed.size() % c.grid, 0u);
    std::map<std::tuple<int32_t, int32_t, int32_t>, int> seen;  // (row, expert, n0)
    std::vector<WalkLoad> in_order[2];
    for (size_t position = 0; position < placed.size(); ++position) {
      const WalkLoad& load = placed[position];
      if (load.a_boxes == 0) continue;
      const int32_t slot = static_cast<int32_t>(position % c.grid);
      const int32_t half = c.parity ? slot % 2 : (slot < lower ? 0 : 1);
      EXPECT_EQ(load.expert >= split ? 1 : 0, half) << "position " << position;
      ++seen[{load.a_row, load.expert, load.n0}];
      in_order[half].push_back(load);
    }
    EXPECT_EQ(seen.size(), loads.size());
    for (const auto& [unit, count] : seen) EXPECT_EQ(count, 1);
    // Each half keeps the walk's order.
    size_t next[2] = {0, 0};
    for (const WalkLoad& load : loads) {
      const int32_t half = load.expert >= split ? 1 : 0;
      const WalkLoad& got = in_order[half][next[half]++];
      EXPECT_EQ(got.a_row, load.a_row);
      EXPECT_EQ(got.n0, load.n0);
    }
    EXPECT_EQ(walk_asked_bytes(spec, WalkForm::kDown, placed, 1024, 64),
              walk_asked_bytes(spec, WalkForm::kDown, loads, 1024, 64));
  }
  EXPECT_THROW(place_by_expert_halves(loads, 10, 1, false), Error);
  EXPECT_THROW(place_by_expert_halves(loads, 10, 8, false, 8), Error);
  EXPECT_THROW(place_by_expert_halves(loads, 10, 8, true, 3), Error);
}

TEST(WalkPlan, RejectsWalksItCannotReplay) {
  const std::vector<int32_t> tiles = {2};
  EXPECT_THROW(plan_walk({"x", 192, 256, 8}, WalkForm::kDown, tiles, 512), Error);
  EXPECT_THROW(plan_walk({"x", 128, 512, 8}, WalkForm::kDown, tiles, 512), Error);
  EXPECT_THROW(plan_walk({"x", 128, 200, 8}, WalkForm::kGateUp, tiles, 512), Error);
  EXPECT_THROW(plan_walk({"x", 128, 256, 0}, WalkForm::kDown, tiles, 512), Error);
}

TEST(WalkPlan, TilesPerExpertFollowTheRouting) {
  const std::vector<int32_t> tiles =
      walk_tiles_per_expert(named_shape("dsv3_e128"), RoutingKind::kUniform, 1);
  ASSERT_EQ(tiles.size(), 128u);
  int32_t total = 0;
  for (const int32_t t : tiles) {
    EXPECT_GE(t, 2);  // 256 +- 16 routed rows each
    EXPECT_LE(t, 3);
    total += t;
  }
  EXPECT_EQ(total, 317);  // counted in session 18 for dsv3_e128's routing, seed 1
}

}  // namespace
}  // namespace mok
