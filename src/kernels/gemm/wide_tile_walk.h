// How the 256 x 192 down GEMM (wide_tile_gemm.cu) walks its row units, shared by host and
// device so the CPU tests check it. A row unit is one or two consecutive 128-row tiles of the
// schedule, both of one expert: each expert's tiles inside the launch's window [m_begin, m_end)
// (its macrobatch) are paired from the first one there, and an odd last tile is a unit alone.
// The units are numbered expert by expert through `unit_start`, the exclusive prefix of each
// expert's unit count, so the grid walks no empty units.
#pragma once

#include <stdint.h>

#include "mok/dtype.h"

namespace mok::kernels {

constexpr int32_t kWideTileRows = 128;  // a schedule tile; a unit holds one or two

// The tiles [*first, *end) of expert `expert` inside the window, from the schedule's segment
// starts (`expert_offsets`, E + 1 entries in rows, multiples of 128).
MOK_HOST_DEVICE inline void expert_window_tiles(const int32_t* expert_offsets, int32_t expert,
                                                int32_t m_begin, int32_t m_end, int32_t* first,
                                                int32_t* end) {
  const int32_t segment_first = expert_offsets[expert] / kWideTileRows;
  const int32_t segment_end = expert_offsets[expert + 1] / kWideTileRows;
  *first = segment_first > m_begin ? segment_first : m_begin;
  *end = segment_end < m_end ? segment_end : m_end;
}

// Row units of an expert with tiles [first, end) in the window.
MOK_HOST_DEVICE inline int32_t wide_row_units(int32_t first, int32_t end) {
  return end > first ? (end - first + 1) / 2 : 0;
}

struct WideRowUnit {
  int32_t expert;
  int32_t m_tile;     // its first schedule tile
  int32_t num_tiles;  // 1 or 2
};

// Row unit `unit` (< unit_start[num_experts]): the expert is the last one whose units start at
// or before it (an empty expert shares its start with the next one, which then holds it).
MOK_HOST_DEVICE inline WideRowUnit wide_row_unit(int32_t unit, const int32_t* unit_start,
                                                 int32_t num_experts, const int32_t* expert_offsets,
                                                 int32_t m_begin, int32_t m_end) {
  int32_t low = 0, high = num_experts - 1;
  while (low < high) {
    const int32_t mid = (low + high + 1) / 2;
    if (unit_start[mid] <= unit)
      low = mid;
    else
      high = mid - 1;
  }
  int32_t first = 0, end = 0;
  expert_window_tiles(expert_offsets, low, m_begin, m_end, &first, &end);
  WideRowUnit row_unit;
  row_unit.expert = low;
  row_unit.m_tile = first + 2 * (unit - unit_start[low]);
  row_unit.num_tiles = row_unit.m_tile + 1 < end ? 2 : 1;
  return row_unit;
}

}  // namespace mok::kernels
