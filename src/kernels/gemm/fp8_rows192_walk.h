// The 192-row tiles of the FP8 row-tile GEMMs (fp8_gemm_192_rows.cu; MoeConfig::
// fp8_row_tile_rows), shared by host and device so the CPU tests check them.
//
// The schedule pads each expert's rows to a multiple of 128 (the layer's row tiles). A 192-row
// tile takes up to three 64-row chunks of one expert: the chunks that hold the expert's routed
// rows (given its routed count; a chunk of padding alone is skipped: its output rows are not
// written, and no stage reads them; about half a chunk an expert under uniform routing), or
// without counts all of its padded rows. They make ceil(chunks / 3) tiles of three chunks, but
// where that would leave a last tile of one chunk behind a full one (chunks = 3 q + 1, q >= 1),
// the last two tiles take two chunks each: a tile with one consumer warpgroup at work leaves the
// tensor pipe idle while it promotes (docs/perf.md: `dsv3_e128`'s 256-row experts ran 1.27x the
// 128-row tiles' time as 192 + 64 in session 48, 1.01x as 128 + 128 in session 49). The same
// tile count either way. No tile crosses an expert, so each reads one expert's weights. The tiles
// are numbered expert by expert: tile_start[e] is the first of expert e's (an exclusive prefix
// sum over the experts, tile_start[E] the count), and a tile's expert is the last e with
// tile_start[e] <= tile (experts without rows hold no tile and are passed over).
#pragma once

#include <stdint.h>

#include "mok/dtype.h"

namespace mok::kernels {

inline constexpr int32_t kRows192 = 192;
inline constexpr int32_t kRows192Chunk = 64;  // a consumer warpgroup's rows
inline constexpr int32_t kRows192Chunks = kRows192 / kRows192Chunk;

// The 64-row chunks of expert e the tiles cover: those holding its routed rows with
// `expert_counts` [num_experts], all of its padded rows without (nullptr).
MOK_HOST_DEVICE inline int32_t rows192_chunks(int32_t e, const int32_t* expert_offsets,
                                              const int32_t* expert_counts) {
  const int32_t rows =
      expert_counts != nullptr ? expert_counts[e] : expert_offsets[e + 1] - expert_offsets[e];
  return (rows + kRows192Chunk - 1) / kRows192Chunk;
}

// The 192-row tiles of `chunks` chunks.
MOK_HOST_DEVICE inline int32_t rows192_tiles(int32_t chunks) {
  return (chunks + kRows192Chunks - 1) / kRows192Chunks;
}

struct Rows192Tile {
  int32_t expert;
  int32_t row0;          // the tile's first row in the schedule's rows
  int32_t valid_chunks;  // 1-3: the chunks of 64 rows that are the expert's
};

// Tile `tile` (< tile_start[num_experts]) from the prefix `tile_start` [num_experts + 1], the
// schedule's `expert_offsets` [num_experts + 1] and its `expert_counts` (or nullptr), as
// rows192_chunks counts them.
MOK_HOST_DEVICE inline Rows192Tile rows192_tile(int32_t tile, const int32_t* tile_start,
                                                int32_t num_experts, const int32_t* expert_offsets,
                                                const int32_t* expert_counts) {
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
  const int32_t begin = expert_offsets[low];
  const int32_t chunks = rows192_chunks(low, expert_offsets, expert_counts);
  const int32_t local = tile - tile_start[low], last = tile_start[low + 1] - tile_start[low] - 1;
  int32_t first_chunk = local * kRows192Chunks;
  t.valid_chunks = chunks - first_chunk < kRows192Chunks ? chunks - first_chunk : kRows192Chunks;
  if (chunks % kRows192Chunks == 1 && last >= 1 && local >= last - 1) {  // 3 + 1 -> 2 + 2
    first_chunk = (last - 1) * kRows192Chunks + (local - (last - 1)) * 2;
    t.valid_chunks = 2;
  }
  t.row0 = begin + first_chunk * kRows192Chunk;
  return t;
}

}  // namespace mok::kernels
