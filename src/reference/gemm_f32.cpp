// Fixed-order fp32 dot product and register-blocked NT product of the CPU reference.
//
// Each output element keeps its 8 lane sums in one 8-wide vector; the microkernel updates a
// 4x3 block of such vectors per step of 8 depth elements (12 accumulators + 3 B rows + 1 A row:
// 16 vector registers with AVX2). Each thread computes whole 64x48 output tiles; depth is walked
// in blocks of 512, the operands of a block packed into sequential panels (the streams stay
// long and cache-friendly) and the lane vectors parked in a tile buffer between blocks. Each
// lane still adds its elements in increasing order, so blocking changes speed, never bits.
// Built with -ffp-contract=off: a product is rounded before it is added, as dot_fixed says.
#include "gemm_f32.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

namespace mok::reference {

namespace {

typedef float v8f __attribute__((vector_size(32)));

inline v8f load8(const float* p) {
  v8f value;
  std::memcpy(&value, p, sizeof(value));
  return value;
}

// Loads `count` < 8 floats and zero-fills the rest. The padded lanes add 0 * 0 = +0 to sums
// that start at +0 and so can never be -0: adding them changes no bit.
inline v8f load_partial(const float* p, int64_t count) {
  float lanes[kDotLanes] = {};
  std::memcpy(lanes, p, static_cast<size_t>(count) * sizeof(float));
  return load8(lanes);
}

inline float reduce_lanes(v8f lanes) {
  return ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
         ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
}

constexpr int64_t kMicroRows = 4;
constexpr int64_t kMicroCols = 3;
constexpr int64_t kTileRows = 16 * kMicroRows;
constexpr int64_t kTileCols = 16 * kMicroCols;
constexpr int64_t kBlockDepth = 512;  // a multiple of kDotLanes: only the last block has a tail
static_assert(kBlockDepth % kDotLanes == 0);

// Packs `rows` (<= panel_rows) rows of a depth block [k_begin, k_end) into a panel: for each
// step of 8 depth elements, the panel rows' 8 values back to back, so the microkernel reads one
// sequential stream per operand. Missing rows and depth past k_end are zero: 0 * 0 = +0 added
// to a lane sum that starts at +0 (and so is never -0) changes no bit.
void pack_panel(const float* src, int64_t ld, int64_t rows, int64_t panel_rows, int64_t k_begin,
                int64_t k_end, float* dst) {
  const int64_t steps = (k_end - k_begin + kDotLanes - 1) / kDotLanes;
  for (int64_t step = 0; step < steps; ++step) {
    const int64_t k = k_begin + step * kDotLanes;
    const int64_t count = std::min<int64_t>(kDotLanes, k_end - k);
    for (int64_t r = 0; r < panel_rows; ++r) {
      float* out = dst + (step * panel_rows + r) * kDotLanes;
      if (r < rows && count == kDotLanes) {
        std::memcpy(out, src + r * ld + k, sizeof(float) * kDotLanes);
      } else {
        for (int lane = 0; lane < kDotLanes; ++lane)
          out[lane] = (r < rows && lane < count) ? src[r * ld + k + lane] : 0.0f;
      }
    }
  }
}

// Adds `steps` steps of a 4-row A panel times a 3-row B panel into the lane vectors
// acc[i * acc_ld + j].
void micro_kernel(const float* a_panel, const float* b_panel, int64_t steps, v8f* acc,
                  int64_t acc_ld) {
  v8f sums[kMicroRows][kMicroCols];
#pragma GCC unroll 4
  for (int i = 0; i < kMicroRows; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kMicroCols; ++j) sums[i][j] = acc[i * acc_ld + j];
  for (int64_t step = 0; step < steps; ++step) {
    const float* a = a_panel + step * kMicroRows * kDotLanes;
    const float* b = b_panel + step * kMicroCols * kDotLanes;
    v8f b_rows[kMicroCols];
#pragma GCC unroll 4
    for (int j = 0; j < kMicroCols; ++j) b_rows[j] = load8(b + j * kDotLanes);
#pragma GCC unroll 4
    for (int i = 0; i < kMicroRows; ++i) {
      const v8f a_row = load8(a + i * kDotLanes);
#pragma GCC unroll 4
      for (int j = 0; j < kMicroCols; ++j) sums[i][j] += a_row * b_rows[j];
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < kMicroRows; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kMicroCols; ++j) acc[i * acc_ld + j] = sums[i][j];
}

// Per-thread scratch of compute_tile, reused across tiles.
struct TileBuffers {
  std::vector<v8f> acc;  // lane vectors of the tile, padded to whole micro-blocks
  std::vector<float> a_packed, b_packed;
};

// One output tile [row0, row0 + tile_rows) x [col0, col0 + tile_cols), whole depth; a bf16
// output gets each fp32 result rounded once.
template <typename Out>
void compute_tile(int64_t row0, int64_t tile_rows, int64_t col0, int64_t tile_cols, int64_t depth,
                  const float* a, int64_t lda, const float* b, int64_t ldb, Out* c, int64_t ldc,
                  TileBuffers& buffers) {
  const int64_t row_panels = (tile_rows + kMicroRows - 1) / kMicroRows;
  const int64_t col_panels = (tile_cols + kMicroCols - 1) / kMicroCols;
  const int64_t acc_ld = col_panels * kMicroCols;
  buffers.acc.assign(static_cast<size_t>(row_panels * kMicroRows * acc_ld), v8f{});
  buffers.a_packed.resize(static_cast<size_t>(row_panels * kMicroRows * kBlockDepth));
  buffers.b_packed.resize(static_cast<size_t>(col_panels * kMicroCols * kBlockDepth));
  for (int64_t k_begin = 0; k_begin < depth; k_begin += kBlockDepth) {
    const int64_t k_end = std::min(depth, k_begin + kBlockDepth);
    const int64_t steps = (k_end - k_begin + kDotLanes - 1) / kDotLanes;
    const int64_t a_panel_size = kMicroRows * steps * kDotLanes;
    const int64_t b_panel_size = kMicroCols * steps * kDotLanes;
    for (int64_t p = 0; p < row_panels; ++p) {
      const int64_t first_row = p * kMicroRows;
      pack_panel(a + (row0 + first_row) * lda, lda, std::min(kMicroRows, tile_rows - first_row),
                 kMicroRows, k_begin, k_end, buffers.a_packed.data() + p * a_panel_size);
    }
    for (int64_t p = 0; p < col_panels; ++p) {
      const int64_t first_col = p * kMicroCols;
      pack_panel(b + (col0 + first_col) * ldb, ldb, std::min(kMicroCols, tile_cols - first_col),
                 kMicroCols, k_begin, k_end, buffers.b_packed.data() + p * b_panel_size);
    }
    for (int64_t i = 0; i < row_panels; ++i)
      for (int64_t j = 0; j < col_panels; ++j)
        micro_kernel(buffers.a_packed.data() + i * a_panel_size,
                     buffers.b_packed.data() + j * b_panel_size, steps,
                     buffers.acc.data() + i * kMicroRows * acc_ld + j * kMicroCols, acc_ld);
  }
  for (int64_t i = 0; i < tile_rows; ++i)
    for (int64_t j = 0; j < tile_cols; ++j) {
      const float sum = reduce_lanes(buffers.acc[i * acc_ld + j]);
      if constexpr (std::is_same_v<Out, bf16>)
        c[(row0 + i) * ldc + col0 + j] = float_to_bf16(sum);
      else
        c[(row0 + i) * ldc + col0 + j] = sum;
    }
}

template <typename Out>
void gemm_nt_impl(ThreadPool& pool, int64_t rows, int64_t cols, int64_t depth, const float* a,
                  int64_t lda, const float* b, int64_t ldb, Out* c, int64_t ldc) {
  if (rows <= 0 || cols <= 0) return;
  const int64_t row_tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t col_tiles = (cols + kTileCols - 1) / kTileCols;
  pool.parallel_for(row_tiles * col_tiles, [&](int64_t tile) {
    thread_local TileBuffers buffers;
    const int64_t row0 = tile / col_tiles * kTileRows;
    const int64_t col0 = tile % col_tiles * kTileCols;
    compute_tile(row0, std::min(kTileRows, rows - row0), col0, std::min(kTileCols, cols - col0),
                 depth, a, lda, b, ldb, c, ldc, buffers);
  });
}

template <typename Source>
float to_float(Source value) {
  if constexpr (std::is_same_v<Source, bf16>)
    return mok::bf16_to_float(value);
  else
    return value;
}

template <typename Source>
void transpose_impl(ThreadPool& pool, const Source* src, int64_t rows, int64_t cols, int64_t src_ld,
                    float* dst, int64_t dst_ld) {
  constexpr int64_t kBlock = 64;
  const int64_t row_blocks = (rows + kBlock - 1) / kBlock;
  const int64_t col_blocks = (cols + kBlock - 1) / kBlock;
  // One task per block of destination rows (source columns), so tasks write disjoint memory.
  pool.parallel_for(col_blocks, [&](int64_t col_block) {
    const int64_t j0 = col_block * kBlock;
    const int64_t j1 = std::min(cols, j0 + kBlock);
    for (int64_t row_block = 0; row_block < row_blocks; ++row_block) {
      const int64_t i0 = row_block * kBlock;
      const int64_t i1 = std::min(rows, i0 + kBlock);
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t i = i0; i < i1; ++i) dst[j * dst_ld + i] = to_float(src[i * src_ld + j]);
    }
  });
}

}  // namespace

float dot_fixed(const float* a, const float* b, int64_t n) {
  v8f lanes{};
  int64_t i = 0;
  for (; i + kDotLanes <= n; i += kDotLanes) lanes += load8(a + i) * load8(b + i);
  if (i < n) lanes += load_partial(a + i, n - i) * load_partial(b + i, n - i);
  return reduce_lanes(lanes);
}

void gemm_nt(ThreadPool& pool, int64_t rows, int64_t cols, int64_t depth, const float* a,
             int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc) {
  gemm_nt_impl(pool, rows, cols, depth, a, lda, b, ldb, c, ldc);
}

void gemm_nt(ThreadPool& pool, int64_t rows, int64_t cols, int64_t depth, const float* a,
             int64_t lda, const float* b, int64_t ldb, bf16* c, int64_t ldc) {
  gemm_nt_impl(pool, rows, cols, depth, a, lda, b, ldb, c, ldc);
}

void convert_bf16_to_float(ThreadPool& pool, const bf16* src, int64_t count, float* dst) {
  constexpr int64_t kChunk = 1 << 16;
  pool.parallel_for((count + kChunk - 1) / kChunk, [&](int64_t chunk) {
    const int64_t end = std::min(count, (chunk + 1) * kChunk);
    for (int64_t i = chunk * kChunk; i < end; ++i) dst[i] = mok::bf16_to_float(src[i]);
  });
}

void transpose_to_float(ThreadPool& pool, const bf16* src, int64_t rows, int64_t cols,
                        int64_t src_ld, float* dst, int64_t dst_ld) {
  transpose_impl(pool, src, rows, cols, src_ld, dst, dst_ld);
}

void transpose_to_float(ThreadPool& pool, const float* src, int64_t rows, int64_t cols,
                        int64_t src_ld, float* dst, int64_t dst_ld) {
  transpose_impl(pool, src, rows, cols, src_ld, dst, dst_ld);
}

}  // namespace mok::reference
