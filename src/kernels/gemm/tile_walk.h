// How the standalone expert GEMM kernel (expert_gemm.cu) walks its tiles, shared by host and
// device so the CPU tests check it: a walk unit is one tile, or with CTA pairs one pair tile
// (row tiles 2u and 2u + 1 of one column tile, one per CTA of the pair).
//   row-tile forms  units grouped `group_size` at a time (MoeConfig::gemm_tile_group, default
//                   kTileGroupM), swept n-major (task_order.h); with
//                   MoeConfig::gemm_expert_aligned_groups, each group's start moved to an
//                   expert's first row tile (aligned_group_start); with
//                   MoeConfig::gemm_expert_groups, groups of one expert's row tiles each
//                   (expert_grouped_tile_in)
//   kWeightGrad     expert by expert; within one, column tile by column tile, row tiles fastest
#pragma once

#include <stdint.h>

#include "kernels/persistent/task_order.h"
#include "mok/dtype.h"

namespace mok::kernels {

struct WalkUnit {
  int32_t m_unit;  // the row tile, or with pairs the pair of row tiles 2 m_unit and 2 m_unit + 1
  int32_t n_tile;
  int32_t expert;  // kWeightGrad; 0 for the row-tile forms
};

// MoeConfig::gemm_expert_aligned_groups: group g's first row tile is the first expert start in
// [g * group_size, g * group_size + reach) where there is one (reach = min(kGroupAlignReach,
// group_size - 1)), else g * group_size. An expert of up to `reach` + 1 row tiles then never
// straddles two groups, whose CTAs would read its weight tiles about one sweep apart, from HBM
// twice (docs/design.md, "Groups that do not split an expert"). The end of the row tiles counts
// as an expert start (a last group may be left empty). The starts stay increasing, so the walk
// still visits every tile once. `tile_expert`: the local expert of each of the walk's
// `m_tiles` row tiles.
inline constexpr int32_t kGroupAlignReach = 4;
MOK_HOST_DEVICE inline int32_t aligned_group_start(int32_t group, int32_t group_size,
                                                   int32_t m_tiles, const int32_t* tile_expert) {
  const int32_t nominal = group * group_size;
  if (group == 0 || nominal >= m_tiles) return nominal < m_tiles ? nominal : m_tiles;
  const int32_t reach = group_size - 1 < kGroupAlignReach ? group_size - 1 : kGroupAlignReach;
  int32_t previous = tile_expert[nominal - 1];
#pragma unroll
  for (int32_t i = 0; i < kGroupAlignReach; ++i) {
    const int32_t tile = nominal + i;
    if (i >= reach) break;
    if (tile >= m_tiles) return m_tiles;  // the last expert ends there: the last group is empty
    const int32_t expert = tile_expert[tile];
    if (expert != previous) return tile;
    previous = expert;
  }
  return nominal;
}

// grouped_tile_in (task_order.h) over those groups: group g holds row tiles [start(g),
// start(g + 1)), swept n-major, and the units before it number start(g) * n_tiles, so unit u's
// group is the one holding row tile u / n_tiles: nominal group u / n_tiles / group_size, or the
// one before it where that starts later.
MOK_HOST_DEVICE inline void aligned_grouped_tile_in(int32_t unit, int32_t m_tiles, int32_t n_tiles,
                                                    int32_t group_size, const int32_t* tile_expert,
                                                    int32_t* m_tile, int32_t* n_tile) {
  const int32_t row = unit / n_tiles;
  int32_t group = row / group_size;
  int32_t first = aligned_group_start(group, group_size, m_tiles, tile_expert);
  int32_t end;
  if (row < first) {
    end = first;
    --group;
    first = aligned_group_start(group, group_size, m_tiles, tile_expert);
  } else {
    end = aligned_group_start(group + 1, group_size, m_tiles, tile_expert);
  }
  const int32_t in_group = unit - first * n_tiles;
  const int32_t group_m = end - first;
  *m_tile = first + in_group % group_m;
  *n_tile = in_group / group_m;
}

// MoeConfig::gemm_expert_groups = max_group: each expert's row tiles form groups of their own,
// swept n-major, an expert of c > max_group tiles split into ceil(c / max_group) groups that
// differ by one tile at most (the longer ones first). Fixed groups of 8 split nearly every
// expert of `dsv3_local`'s ~9 row tiles in two, whose weight tiles are then read a sweep apart,
// from HBM twice (docs/design.md, "Groups of one expert"). The walk covers the window of row
// tiles [tile_base, tile_base + m_tiles) (an expert's tiles cut to it) and returns m_tile
// relative to it. The units before an expert's tiles number (its first tile) * n_tiles, so unit
// u's expert is that of row tile u / n_tiles: one read of `tile_expert` (indexed from schedule
// tile 0) and two of `expert_offsets` (rows, multiples of `row_align`).
MOK_HOST_DEVICE inline void expert_grouped_tile_in(int32_t unit, int32_t tile_base, int32_t m_tiles,
                                                   int32_t n_tiles, int32_t max_group,
                                                   const int32_t* tile_expert,
                                                   const int32_t* expert_offsets, int32_t row_align,
                                                   int32_t* m_tile, int32_t* n_tile) {
  const int32_t row = unit / n_tiles;
  const int32_t expert = tile_expert[tile_base + row];
  int32_t first = expert_offsets[expert] / row_align - tile_base;
  int32_t end = expert_offsets[expert + 1] / row_align - tile_base;
  if (first < 0) first = 0;
  if (end > m_tiles) end = m_tiles;
  const int32_t count = end - first;
  const int32_t groups = (count + max_group - 1) / max_group;
  const int32_t base_size = count / groups, longer = count % groups;  // `longer` of base_size + 1
  const int32_t in_expert = row - first, long_rows = longer * (base_size + 1);
  int32_t group_first, group_m;
  if (in_expert < long_rows) {
    group_m = base_size + 1;
    group_first = in_expert / group_m * group_m;
  } else {
    group_m = base_size;
    group_first = long_rows + (in_expert - long_rows) / group_m * group_m;
  }
  const int32_t in_group = unit - (first + group_first) * n_tiles;
  *m_tile = first + group_first + in_group % group_m;
  *n_tile = in_group / group_m;
}

// `m_units`: row tiles per column tile (and expert), or with pairs their pair count.
// `group_size`: the row-tile forms' group (kWeightGrad ignores it). `aligned_tile_expert`: with
// MoeConfig::gemm_expert_aligned_groups, the local expert of each of the `m_units` row tiles
// (the row-tile forms without pairs); null: groups of exactly `group_size`.
MOK_HOST_DEVICE inline WalkUnit walk_unit(int32_t unit, int32_t m_units, int32_t num_n_tiles,
                                          bool row_tiles, int32_t group_size = kTileGroupM,
                                          const int32_t* aligned_tile_expert = nullptr) {
  WalkUnit walk{0, 0, 0};
  if (row_tiles && aligned_tile_expert != nullptr) {
    aligned_grouped_tile_in(unit, m_units, num_n_tiles, group_size, aligned_tile_expert,
                            &walk.m_unit, &walk.n_tile);
  } else if (row_tiles) {
    grouped_tile_in(unit, m_units, num_n_tiles, group_size, &walk.m_unit, &walk.n_tile);
  } else {
    const int32_t per_expert = m_units * num_n_tiles;
    walk.expert = unit / per_expert;
    const int32_t local = unit - walk.expert * per_expert;
    walk.n_tile = local / m_units;
    walk.m_unit = local % m_units;
  }
  return walk;
}

// With pairs: the row tile of CTA `rank` in pair unit `m_unit` (`num_m_tiles` of them), and
// whether it is a phantom (the pair's second tile past the last: it passes the stages empty).
struct PairRow {
  int32_t m_tile;  // a phantom's is its partner's (for the K-block count)
  bool phantom;
  bool partner_exists;
};
MOK_HOST_DEVICE inline PairRow pair_row(int32_t m_unit, int32_t rank, int32_t num_m_tiles) {
  const int32_t first = 2 * m_unit;
  const bool partner_exists = first + 1 < num_m_tiles;
  const bool phantom = rank == 1 && !partner_exists;
  return {phantom ? first : first + rank, phantom, partner_exists};
}

}  // namespace mok::kernels
