// How the standalone expert GEMM kernel (expert_gemm.cu) walks its tiles, shared by host and
// device so the CPU tests check it: a walk unit is one tile, or with CTA pairs one pair tile
// (row tiles 2u and 2u + 1 of one column tile, one per CTA of the pair).
//   row-tile forms  units grouped `group_size` at a time (MoeConfig::gemm_tile_group, default
//                   kTileGroupM), swept n-major (task_order.h)
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

// `m_units`: row tiles per column tile (and expert), or with pairs their pair count.
// `group_size`: the row-tile forms' group (kWeightGrad ignores it).
MOK_HOST_DEVICE inline WalkUnit walk_unit(int32_t unit, int32_t m_units, int32_t num_n_tiles,
                                          bool row_tiles, int32_t group_size = kTileGroupM) {
  WalkUnit walk{0, 0, 0};
  if (row_tiles) {
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
