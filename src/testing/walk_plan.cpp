// The walks of `mok walk-bench` (mok/testing/walk_bench.h): host-side plans of the units a GEMM
// walks, CPU-tested against the kernels' own walks (tests/cpu/test_walk_plan.cpp).
#include <algorithm>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/persistent/task_order.h"
#include "mok/error.h"
#include "mok/testing/walk_bench.h"

namespace mok {

namespace {

constexpr int32_t kScheduleTileRows = 128;

struct RowUnit {
  int32_t first_tile;
  int32_t num_tiles;
  int32_t expert;
};

}  // namespace

std::vector<WalkLoad> plan_walk(const WalkSpec& spec, WalkForm form,
                                const std::vector<int32_t>& tiles_per_expert, int64_t n_extent) {
  if ((spec.tile_rows != 128 && spec.tile_rows != 256) || spec.group < 1 || spec.tile_n < 64 ||
      spec.tile_n > 256 || spec.tile_n % (form == WalkForm::kGateUp ? 16 : 8) != 0 || n_extent < 1)
    throw Error(ErrorCode::kInvalidArgument,
                "plan_walk: walk '" + spec.name + "' has tile_rows " +
                    std::to_string(spec.tile_rows) + ", tile_n " + std::to_string(spec.tile_n) +
                    ", group " + std::to_string(spec.group) +
                    "; valid: tile_rows 128 or 256, tile_n in [64, 256] (a multiple of 16 for "
                    "gate/up), group >= 1");
  std::vector<RowUnit> rows;
  int32_t tile = 0;
  for (int32_t expert = 0; expert < static_cast<int32_t>(tiles_per_expert.size()); ++expert) {
    const int32_t tiles = tiles_per_expert[expert];
    const int32_t per_unit = spec.tile_rows / kScheduleTileRows;
    for (int32_t t = 0; t < tiles; t += per_unit)
      rows.push_back({tile + t, std::min(per_unit, tiles - t), expert});
    tile += tiles;
  }
  if (spec.lone_last)
    std::stable_partition(rows.begin(), rows.end(), [&](const RowUnit& row) {
      return row.num_tiles * kScheduleTileRows == spec.tile_rows;
    });
  const int32_t columns = form == WalkForm::kGateUp ? spec.tile_n / 2 : spec.tile_n;
  const int32_t n_tiles = static_cast<int32_t>((n_extent + columns - 1) / columns);
  const int32_t m_units = static_cast<int32_t>(rows.size());
  std::vector<WalkLoad> loads;
  loads.reserve(static_cast<size_t>(m_units) * n_tiles);
  for (int32_t unit = 0; unit < m_units * n_tiles; ++unit) {
    int32_t m_unit = 0, n_tile = 0;
    kernels::grouped_tile_in(unit, m_units, n_tiles, spec.group, &m_unit, &n_tile);
    const RowUnit& row = rows[m_unit];
    loads.push_back(
        {row.first_tile * kScheduleTileRows, row.num_tiles, row.expert, n_tile * columns});
  }
  return loads;
}

std::vector<WalkLoad> place_by_expert_halves(const std::vector<WalkLoad>& loads,
                                             int32_t num_experts, int32_t grid, bool parity,
                                             int32_t lower_slots) {
  if (lower_slots < 0) lower_slots = parity ? (grid + 1) / 2 : grid / 2;
  if (grid < 2 || num_experts < 1 || lower_slots < 1 || lower_slots >= grid ||
      (parity && lower_slots != (grid + 1) / 2))
    throw Error(ErrorCode::kInvalidArgument,
                "place_by_expert_halves: grid = " + std::to_string(grid) + ", num_experts = " +
                    std::to_string(num_experts) + ", lower_slots = " + std::to_string(lower_slots) +
                    "; valid: grid >= 2, num_experts >= 1, lower_slots in [1, grid) (with parity "
                    "(grid + 1) / 2)");
  // The experts split as the slots do.
  const int32_t split_expert =
      static_cast<int32_t>((static_cast<int64_t>(num_experts) * lower_slots + grid / 2) / grid);
  std::vector<WalkLoad> halves[2];
  for (const WalkLoad& load : loads) halves[load.expert >= split_expert ? 1 : 0].push_back(load);
  // Slots of each half: [0, lower_slots) and [lower_slots, grid), or the even and the odd ones.
  const int32_t slots[2] = {lower_slots, grid - lower_slots};
  auto slot_of = [&](int32_t half, int32_t i) {
    return parity ? 2 * i + half : half * lower_slots + i;
  };
  size_t waves = 0;
  for (int32_t h = 0; h < 2; ++h)
    waves = std::max(waves, (halves[h].size() + slots[h] - 1) / slots[h]);
  std::vector<WalkLoad> out(waves * grid, WalkLoad{0, 0, 0, 0});
  for (int32_t h = 0; h < 2; ++h)
    for (size_t j = 0; j < halves[h].size(); ++j)
      out[(j / slots[h]) * grid + slot_of(h, static_cast<int32_t>(j % slots[h]))] = halves[h][j];
  return out;
}

std::vector<int32_t> walk_tiles_per_expert(const MoeShape& shape, RoutingKind routing,
                                           uint64_t seed) {
  const int32_t experts = static_cast<int32_t>(shape.num_local_experts());
  const std::vector<int32_t> slots = generate_routing(
      routing, 1, static_cast<int32_t>(shape.num_tokens), shape.top_k, experts, seed);
  std::vector<int32_t> counts(experts, 0);
  for (const int32_t expert : slots)
    if (expert >= 0) ++counts[expert];
  std::vector<int32_t> tiles(experts);
  for (int32_t e = 0; e < experts; ++e)
    tiles[e] = (counts[e] + kScheduleTileRows - 1) / kScheduleTileRows;
  return tiles;
}

int64_t walk_asked_bytes(const WalkSpec& spec, WalkForm form, const std::vector<WalkLoad>& loads,
                         int64_t n_extent, int64_t k) {
  const int64_t row_bytes = k * 2;
  const int64_t columns = form == WalkForm::kGateUp ? spec.tile_n / 2 : spec.tile_n;
  const int64_t b_sets = form == WalkForm::kGateUp ? 2 : 1;  // gate and up
  int64_t bytes = 0;
  for (const WalkLoad& load : loads) {
    if (load.a_boxes == 0) continue;  // padding
    bytes += load.a_boxes * int64_t{kScheduleTileRows} * row_bytes;
    bytes += b_sets * std::min<int64_t>(columns, n_extent - load.n0) * row_bytes;
  }
  return bytes;
}

int64_t walk_wave_unique_bytes(const WalkSpec& spec, WalkForm form,
                               const std::vector<WalkLoad>& loads, int64_t n_extent, int64_t k,
                               int32_t grid) {
  if (grid < 1)
    throw Error(ErrorCode::kInvalidArgument,
                "walk_wave_unique_bytes: grid = " + std::to_string(grid) + "; valid: >= 1");
  const int64_t row_bytes = k * 2;
  const int64_t columns = form == WalkForm::kGateUp ? spec.tile_n / 2 : spec.tile_n;
  const int64_t b_sets = form == WalkForm::kGateUp ? 2 : 1;
  int64_t bytes = 0;
  for (size_t wave = 0; wave < loads.size(); wave += grid) {
    std::set<int32_t> a_boxes;                 // first row of each 128-row box
    std::set<std::tuple<int32_t, int32_t>> b;  // (expert, n0)
    for (size_t u = wave; u < std::min(loads.size(), wave + grid); ++u) {
      if (loads[u].a_boxes == 0) continue;  // padding
      for (int32_t box = 0; box < loads[u].a_boxes; ++box)
        a_boxes.insert(loads[u].a_row + kScheduleTileRows * box);
      if (b.insert({loads[u].expert, loads[u].n0}).second)
        bytes += b_sets * std::min<int64_t>(columns, n_extent - loads[u].n0) * row_bytes;
    }
    bytes += static_cast<int64_t>(a_boxes.size()) * kScheduleTileRows * row_bytes;
  }
  return bytes;
}

}  // namespace mok
