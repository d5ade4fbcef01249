// The 192-row tiles of the FP8 row-tile GEMMs (fp8_gemm_192_rows.cu; MoeConfig::
// fp8_row_tile_rows), shared by host and device so the CPU tests check them.
//
// The schedule pads each expert's rows to a multiple of 128 (the layer's row tiles). A 192-row
// tile takes three 64-row chunks of one expert: expert e's rows [offsets[e], offsets[e + 1])
// make ceil(chunks / 3) tiles, the last one with 1, 2 or 3 chunks (128 q rows leave 0, 64 or
// 128 over a multiple of 192). No tile crosses an expert, so each reads one expert's weights.
// The tiles are numbered expert by expert: tile_start[e] is the first of expert e's
// (an exclusive prefix sum over the experts, tile_start[E] the count), and a tile's expert is the
// last e with tile_start[e] <= tile (experts without rows hold no tile and are passed over).
#pragma once

#include <stdint.h>

#include "mok/dtype.h"

namespace mok::kernels {

inline constexpr int32_t kRows192 = 192;
inline constexpr int32_t kRows192Chunk = 64;  // a consumer warpgroup's rows
inline constexpr int32_t kRows192Chunks = kRows192 / kRows192Chunk;

// The 192-row tiles of an expert of `rows` rows (a multiple of 128).
MOK_HOST_DEVICE inline int32_t rows192_tiles(int32_t rows) {
  return (rows / kRows192Chunk + kRows192Chunks - 1) / kRows192Chunks;
}

struct Rows192Tile {
  int32_t expert;
  int32_t row0;          // the tile's first row in the schedule's rows
  int32_t valid_chunks;  // 1-3: the chunks of 64 rows that are the expert's
};

// Tile `tile` (< tile_start[num_experts]) from the prefix `tile_start` [num_experts + 1] and the
// schedule's `expert_offsets` [num_experts + 1].
MOK_HOST_DEVICE inline Rows192Tile rows192_tile(int32_t tile, const int32_t* tile_start,
                                                int32_t num_experts,
                                                const int32_t* expert_offsets) {
  int32_t low = 0, high = num_experts;  // tile_start[low] <= tile < tile_start[high]
  while (high - low > 1) {
    const int32_t middle = (low + high) / 2;
    if (tile_start[middle] <= tile)
      low = middle;
    else
      high = middle;
  }
  Rows192Tile t;
  t.expert = low;
  const int32_t begin = expert_offsets[low], end = expert_offsets[low + 1];
  t.row0 = begin + (tile - tile_start[low]) * kRows192;
  const int32_t left = (end - t.row0) / kRows192Chunk;
  t.valid_chunks = left < kRows192Chunks ? left : kRows192Chunks;
  return t;
}

}  // namespace mok::kernels
