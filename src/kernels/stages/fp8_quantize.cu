// The FP8 quantizers (fp8_quantize.h), bit-exact with mok/fp8.h's host quantizers, the
// quantization of gathered rows, and the transposition of pre-quantized weight blocks.
//
// Grid: one 256-thread CTA per 128 x 128 tile of the input. The CTA stages the tile in shared
// memory (16-byte loads, bf16, rows 272 bytes apart), then quantizes it:
// - row groups: each thread holds half a row (16-byte shared loads, eight rows per phase: no
//   bank conflict); the amax runs on bf16 pairs (HMNMX2 .abs .NaN), one shuffle joins the
//   halves, and the row's two threads write whole 32-byte sectors;
// - column groups: each thread holds half a column of the tile; a group's amax is its two
//   halves' (one shuffle).
// The weights' blocks have a kernel of their own (quantize_weight_blocks_kernel): one block per
// CTA, loaded straight into registers (no bf16 staging), its amax the CTA's (bf16 pairs, shuffles,
// the 8 warps through shared memory), and both layouts written in one pass when asked: the codes
// as they are, whole 128-byte lines per warp store, and transposed through a shared-memory tile
// of codes, whole lines again.
// Every maximum propagates NaN, as the host's does. The factors come from fp8_group_scale
// (mok/fp8.h: two IEEE divisions), each value is multiplied by the inverse scale in fp32 (a power
// of two: exact), and the conversion is the hardware's cvt.rn.satfinite.e4m3x2.f32.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "kernels/common/ptx.cuh"
#include "kernels/stages/fp8_quantize.h"
#include "mok/fp8.h"

namespace mok::kernels {

namespace {

constexpr int kTile = 128;
constexpr int kThreads = 256;
constexpr int kPitch = kTile + 8;  // bf16 per staged row: 16-byte aligned rows, fewer conflicts

// Two values -> their e4m3 codes in the low and the high byte.
__device__ __forceinline__ uint16_t to_e4m3x2(float low, float high) {
  return static_cast<uint16_t>(
      __nv_cvt_float2_to_fp8x2(make_float2(low, high), __NV_SATFINITE, __NV_E4M3));
}

using StagedTile = __nv_bfloat16[kTile][kPitch];
// 128 lines of codes; the pitch keeps them 16-byte aligned, and a quarter-warp's 16-byte stores
// (two halves of each of four lines) on distinct banks.
constexpr int kCodePitch = kTile + 16;
using CodeTile = uint8_t[kTile][kCodePitch];

// Thread (line, half)'s 64 values of a staged tile: half of row `line`, or of column `line`.
template <bool kAlongColumns>
__device__ __forceinline__ void load_line(const StagedTile& tile, int line, int half,
                                          float (&values)[64]) {
  for (int i = 0; i < 64; ++i) {
    const int along = half * 64 + i;
    values[i] = __bfloat162float(kAlongColumns ? tile[along][line] : tile[line][along]);
  }
}

// The largest magnitude of the line the thread pair (lanes 2j, 2j + 1) holds, NaN if any.
__device__ __forceinline__ float line_amax(const float (&values)[64]) {
  float amax = 0.0f;
  for (int i = 0; i < 64; ++i) amax = ptx::max_nan(amax, fabsf(values[i]));
  return ptx::max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
}

// Four values' codes as one word, the first value in the low byte.
__device__ __forceinline__ uint32_t codes4(float v0, float v1, float v2, float v3, float inverse) {
  return uint32_t(to_e4m3x2(v0 * inverse, v1 * inverse)) |
         (uint32_t(to_e4m3x2(v2 * inverse, v3 * inverse)) << 16);
}

// The 64 values' codes as four 16-byte stores at `destination`.
__device__ __forceinline__ void store_codes(const float (&values)[64], const Fp8GroupScale& factors,
                                            uint4* destination) {
  for (int chunk = 0; chunk < 4; ++chunk) {
    uint32_t words[4];
    for (int w = 0; w < 4; ++w) {
      const int i = chunk * 16 + w * 4;
      words[w] =
          codes4(values[i], values[i + 1], values[i + 2], values[i + 3], factors.inverse_scale);
    }
    destination[chunk] = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// A bf16 pair's two values (low half first).
__device__ __forceinline__ float low_bf16(uint32_t pair) { return __uint_as_float(pair << 16); }
__device__ __forceinline__ float high_bf16(uint32_t pair) {
  return __uint_as_float(pair & 0xffff0000u);
}

// The larger magnitude of a max_abs_bf16x2_nan result's two halves, as a float (NaN if either
// is: canonical, as the float maxima's).
__device__ __forceinline__ float halves_amax(uint32_t pair) {
  return ptx::max_nan(fabsf(low_bf16(pair)), fabsf(high_bf16(pair)));
}

// The largest magnitude (NaN if any is NaN) of eight vectors of eight bf16 values, bf16x2: one
// thread's loaded run, to reduce with halves_amax.
__device__ __forceinline__ uint32_t max_abs_of(const uint4 (&values)[8]) {
  uint32_t running = 0;
#pragma unroll
  for (int v = 0; v < 8; ++v)
    running = ptx::max_abs_bf16x2_nan(
        running, ptx::max_abs_bf16x2_nan(ptx::max_abs_bf16x2_nan(values[v].x, values[v].y),
                                         ptx::max_abs_bf16x2_nan(values[v].z, values[v].w)));
  return running;
}

// kRowGroups of one staged tile (tile row `tile_row`, column `tile_col` of a [rows, cols]
// matrix) into out [rows, cols] and scales [cols/128, rows]. Lane l of warp w holds half l / 16
// of row 16 w + l % 16, as four runs of 16 columns (32 c + 16 half ..): a shared-memory phase's
// eight lanes read eight rows at eight 16-byte bank offsets (the 272-byte pitch), and the two
// lanes of a row write one whole 32-byte sector per store.
__device__ __forceinline__ void quantize_row_groups(const StagedTile& tile, int64_t tile_row,
                                                    int64_t tile_col, int64_t rows, int64_t cols,
                                                    uint8_t* out, float* scales) {
  const int lane = threadIdx.x % 32;
  const int line = (threadIdx.x / 32) * 16 + lane % 16, half = lane / 16;
  uint4 pairs[8];  // run c's 16 values in pairs[2c], pairs[2c + 1]
#pragma unroll
  for (int v = 0; v < 8; ++v)
    pairs[v] = *reinterpret_cast<const uint4*>(&tile[line][(v / 2) * 32 + half * 16 + (v % 2) * 8]);
  float amax = halves_amax(max_abs_of(pairs));
  amax = ptx::max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, 16));
  const Fp8GroupScale factors = fp8_group_scale(amax);
  const float inverse = factors.inverse_scale;
  uint8_t* destination = out + (tile_row * kTile + line) * cols + tile_col * kTile + half * 16;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const uint4& source = pairs[2 * c + w / 2];
      const uint32_t first = w % 2 ? source.z : source.x, second = w % 2 ? source.w : source.y;
      words[w] =
          codes4(low_bf16(first), high_bf16(first), low_bf16(second), high_bf16(second), inverse);
    }
    *reinterpret_cast<uint4*>(destination + c * 32) =
        make_uint4(words[0], words[1], words[2], words[3]);
  }
  if (half == 0) scales[tile_col * rows + tile_row * kTile + line] = factors.scale;
}

// kColumnGroups of one staged tile (tile row `tile_row`, column `tile_col` of a [rows, cols]
// matrix) into out [cols, rows] (the transpose) and scales [rows/128, cols]: each thread holds
// half a column (the blocks' transposed layout's lines). The codes go back through the tile's
// own shared memory, which the values have left for registers, so that every 16-byte global
// store belongs to a whole 128-byte line that eight threads write together; stored straight
// from the threads, each store instruction wrote 16 bytes into each of 16 lines. The last use
// of the tile: the caller reads it no more. (A layout of two columns of 32 rows per thread,
// with the quarters' maxima through shared memory, measured slower: docs/perf.md, session 29.)
__device__ __forceinline__ void quantize_column_groups(StagedTile& tile, int64_t tile_row,
                                                       int64_t tile_col, int64_t rows, int64_t cols,
                                                       uint8_t* out, float* scales) {
  const int line = threadIdx.x / 2, half = threadIdx.x % 2;
  float values[64];
  load_line<true>(tile, line, half, values);
  const Fp8GroupScale factors = fp8_group_scale(line_amax(values));
  const int64_t out_row0 = tile_col * kTile;
  if (half == 0) scales[tile_row * cols + out_row0 + line] = factors.scale;
  static_assert(sizeof(CodeTile) <= sizeof(StagedTile), "the codes fit in the staged tile");
  CodeTile& codes = *reinterpret_cast<CodeTile*>(&tile);
  __syncthreads();  // every thread holds its values: the tile's memory takes the codes
  store_codes(values, factors, reinterpret_cast<uint4*>(&codes[line][half * 64]));
  __syncthreads();
  for (int v = threadIdx.x; v < kTile * (kTile / 16); v += kThreads) {
    const int r = v / (kTile / 16), c = (v % (kTile / 16)) * 16;
    *reinterpret_cast<uint4*>(out + (out_row0 + r) * rows + tile_row * kTile + c) =
        *reinterpret_cast<const uint4*>(&codes[r][c]);
  }
}

template <Fp8QuantizeForm kForm>
__global__ void __launch_bounds__(kThreads)
    quantize_fp8_kernel(const __nv_bfloat16* in, int64_t rows, int64_t cols, uint8_t* out,
                        float* scales, Fp8QuantizeBatch batch) {
  in += blockIdx.z * batch.in_stride;
  out += blockIdx.z * batch.out_stride;
  scales += blockIdx.z * batch.scales_stride;
  __shared__ __align__(16) StagedTile tile;
  const int64_t tile_col = blockIdx.x, tile_row = blockIdx.y;
  const int64_t row0 = tile_row * kTile, col0 = tile_col * kTile;
  // Stage the tile: 128 rows x 16 vectors of 8 bf16.
  for (int v = threadIdx.x; v < kTile * (kTile / 8); v += kThreads) {
    const int r = v / (kTile / 8), c = (v % (kTile / 8)) * 8;
    *reinterpret_cast<uint4*>(&tile[r][c]) =
        *reinterpret_cast<const uint4*>(in + (row0 + r) * cols + col0 + c);
  }
  __syncthreads();

  static_assert(kForm == Fp8QuantizeForm::kRowGroups || kForm == Fp8QuantizeForm::kColumnGroups,
                "the blocks: quantize_weight_blocks_kernel");
  if constexpr (kForm == Fp8QuantizeForm::kRowGroups)
    quantize_row_groups(tile, tile_row, tile_col, rows, cols, out, scales);
  else
    quantize_column_groups(tile, tile_row, tile_col, rows, cols, out, scales);
}

// kBlocks and kBlocksTransposed of a batch of [rows, cols] matrices (blockIdx.z the entry), one
// 128 x 128 block per CTA, either layout or both (a null `out` or `out_t` skips it). Lane l of
// warp w loads columns 8 (l % 16) .. + 7 of rows 16 w + 2 i + l / 16, i = 0..7: eight 16-byte
// loads in flight per thread, each warp load two whole 256-byte rows. The codes of the layout
// as it is leave as 8-byte stores, a warp store two whole 128-byte lines; the transposed ones go
// into a shared code tile, each thread then gathers half a column of it (64 bytes), and the
// gathered lines go back through the same tile so that the global stores are whole lines too.
__global__ void __launch_bounds__(kThreads)
    quantize_weight_blocks_kernel(const __nv_bfloat16* in, int64_t rows, int64_t cols, uint8_t* out,
                                  float* scales, uint8_t* out_t, float* scales_t,
                                  Fp8QuantizeBatch batch) {
  in += blockIdx.z * batch.in_stride;
  const int64_t tile_col = blockIdx.x, tile_row = blockIdx.y;
  const int64_t row0 = tile_row * kTile, col0 = tile_col * kTile;
  __shared__ __align__(16) CodeTile codes;
  __shared__ float warp_amax[kThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int column = (lane % 16) * 8;
  auto row_of = [&](int i) { return warp * 16 + 2 * i + lane / 16; };
  uint4 loaded[8];
#pragma unroll
  for (int i = 0; i < 8; ++i)
    loaded[i] =
        __ldg(reinterpret_cast<const uint4*>(in + (row0 + row_of(i)) * cols + col0 + column));
  float amax = halves_amax(max_abs_of(loaded));
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2)
    amax = ptx::max_nan(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  if (lane == 0) warp_amax[warp] = amax;
  __syncthreads();
  amax = warp_amax[0];
#pragma unroll
  for (int w = 1; w < kThreads / 32; ++w) amax = ptx::max_nan(amax, warp_amax[w]);
  const Fp8GroupScale factors = fp8_group_scale(amax);
  const float inverse = factors.inverse_scale;
  uint2 row_codes[8];  // row row_of(i)'s eight codes at `column`
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint4& v = loaded[i];
    row_codes[i] =
        make_uint2(codes4(low_bf16(v.x), high_bf16(v.x), low_bf16(v.y), high_bf16(v.y), inverse),
                   codes4(low_bf16(v.z), high_bf16(v.z), low_bf16(v.w), high_bf16(v.w), inverse));
  }
  if (out != nullptr) {
    out += blockIdx.z * batch.out_stride;
#pragma unroll
    for (int i = 0; i < 8; ++i)
      *reinterpret_cast<uint2*>(out + (row0 + row_of(i)) * cols + col0 + column) = row_codes[i];
    if (threadIdx.x == 0)
      scales[blockIdx.z * batch.scales_stride + tile_row * (cols / kTile) + tile_col] =
          factors.scale;
  }
  if (out_t == nullptr) return;
  out_t += blockIdx.z * batch.out_stride;
#pragma unroll
  for (int i = 0; i < 8; ++i) *reinterpret_cast<uint2*>(&codes[row_of(i)][column]) = row_codes[i];
  __syncthreads();
  // Thread (line, half): column `line` of the block, rows half * 64 .. + 63, as four words of
  // four rows' bytes per 16-byte chunk.
  const int line = threadIdx.x / 2, half = threadIdx.x % 2;
  uint4 gathered[4];
#pragma unroll
  for (int chunk = 0; chunk < 4; ++chunk) {
    uint32_t words[4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int r = half * 64 + chunk * 16 + w * 4;
      words[w] = uint32_t(codes[r][line]) | (uint32_t(codes[r + 1][line]) << 8) |
                 (uint32_t(codes[r + 2][line]) << 16) | (uint32_t(codes[r + 3][line]) << 24);
    }
    gathered[chunk] = make_uint4(words[0], words[1], words[2], words[3]);
  }
  __syncthreads();  // every column gathered: the tile takes the transposed lines
#pragma unroll
  for (int chunk = 0; chunk < 4; ++chunk)
    *reinterpret_cast<uint4*>(&codes[line][half * 64 + chunk * 16]) = gathered[chunk];
  __syncthreads();
  for (int v = threadIdx.x; v < kTile * (kTile / 16); v += kThreads) {
    const int r = v / (kTile / 16), c = (v % (kTile / 16)) * 16;
    *reinterpret_cast<uint4*>(out_t + (col0 + r) * rows + row0 + c) =
        *reinterpret_cast<const uint4*>(&codes[r][c]);
  }
  if (threadIdx.x == 0)
    scales_t[blockIdx.z * batch.scales_stride + tile_col * (rows / kTile) + tile_row] =
        factors.scale;
}

// Gathered rows quantized as they are staged (Fp8GatherQuantize): the tile's rows come from the
// tokens' rows through the schedule (zeros for padding rows and rows past total_rows); a tile
// wholly past total_rows writes nothing. The tile's 128 token indices are read first, so that
// each thread's eight 16-byte loads are independent and in flight together.
__global__ void __launch_bounds__(kThreads) gather_quantize_fp8_kernel(Fp8GatherQuantize p) {
  constexpr int kVectorsPerThread = kTile * (kTile / 8) / kThreads;
  __shared__ __align__(16) StagedTile tile;
  __shared__ int64_t tile_tokens[kTile];
  const int64_t tile_col = blockIdx.x, tile_row = blockIdx.y;
  const int64_t row0 = tile_row * kTile, col0 = tile_col * kTile;
  const int64_t total_rows = p.header->total_rows;
  if (row0 >= total_rows) return;
  if (threadIdx.x < kTile) {
    const int64_t row = row0 + threadIdx.x;
    if (p.row_pair == nullptr) {  // the rows themselves
      tile_tokens[threadIdx.x] = row < total_rows ? row : -1;
    } else {
      const int32_t pair = row < total_rows ? p.row_pair[row] : -1;
      tile_tokens[threadIdx.x] = pair >= 0 ? pair / p.top_k : -1;
    }
  }
  __syncthreads();
  const auto* tokens = static_cast<const __nv_bfloat16*>(p.tokens);
  uint4 loaded[kVectorsPerThread];
#pragma unroll
  for (int k = 0; k < kVectorsPerThread; ++k) {
    const int v = threadIdx.x + k * kThreads, r = v / (kTile / 8), c = (v % (kTile / 8)) * 8;
    const int64_t token = tile_tokens[r];
    loaded[k] = token >= 0
                    ? __ldg(reinterpret_cast<const uint4*>(tokens + token * p.cols + col0 + c))
                    : make_uint4(0, 0, 0, 0);
  }
#pragma unroll
  for (int k = 0; k < kVectorsPerThread; ++k) {
    const int v = threadIdx.x + k * kThreads, r = v / (kTile / 8), c = (v % (kTile / 8)) * 8;
    *reinterpret_cast<uint4*>(&tile[r][c]) = loaded[k];
    if (p.rows_bf16 != nullptr && row0 + r < total_rows)
      *reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.rows_bf16) + (row0 + r) * p.cols +
                                col0 + c) = loaded[k];
  }
  __syncthreads();
  if (p.row_codes != nullptr)
    quantize_row_groups(tile, tile_row, tile_col, p.capacity_rows, p.cols,
                        static_cast<uint8_t*>(p.row_codes), p.row_scales);
  if (p.column_codes != nullptr)
    quantize_column_groups(tile, tile_row, tile_col, p.capacity_rows, p.cols,
                           static_cast<uint8_t*>(p.column_codes), p.column_scales);
}

// One 128 x 128 block of codes transposed through shared memory: 16-byte loads of its rows,
// then each thread gathers 64 bytes of one column (half a line of the output) and writes them
// as four 16-byte stores.
__global__ void __launch_bounds__(kThreads)
    transpose_fp8_blocks_kernel(const uint8_t* codes, const float* scales, int64_t rows,
                                int64_t cols, uint8_t* out, float* out_scales,
                                Fp8QuantizeBatch batch) {
  codes += blockIdx.z * batch.in_stride;
  out += blockIdx.z * batch.out_stride;
  scales += blockIdx.z * batch.scales_stride;
  out_scales += blockIdx.z * batch.scales_stride;
  __shared__ __align__(16) CodeTile tile;
  const int64_t tile_col = blockIdx.x, tile_row = blockIdx.y;
  const int64_t row0 = tile_row * kTile, col0 = tile_col * kTile;
  for (int v = threadIdx.x; v < kTile * (kTile / 16); v += kThreads) {
    const int r = v / (kTile / 16), c = (v % (kTile / 16)) * 16;
    *reinterpret_cast<uint4*>(&tile[r][c]) =
        *reinterpret_cast<const uint4*>(codes + (row0 + r) * cols + col0 + c);
  }
  __syncthreads();
  const int line = threadIdx.x / 2, half = threadIdx.x % 2;
  uint4* destination = reinterpret_cast<uint4*>(out + (col0 + line) * rows + row0 + half * 64);
  for (int chunk = 0; chunk < 4; ++chunk) {
    uint32_t words[4];
    for (int w = 0; w < 4; ++w) {
      const int r = half * 64 + chunk * 16 + w * 4;
      words[w] = uint32_t(tile[r][line]) | (uint32_t(tile[r + 1][line]) << 8) |
                 (uint32_t(tile[r + 2][line]) << 16) | (uint32_t(tile[r + 3][line]) << 24);
    }
    destination[chunk] = make_uint4(words[0], words[1], words[2], words[3]);
  }
  if (threadIdx.x == 0)
    out_scales[tile_col * (rows / kTile) + tile_row] = scales[tile_row * (cols / kTile) + tile_col];
}

// The extents the tile kernels take: multiples of 128, and a batch that the grid's z can hold.
bool tiled_extents_valid(int64_t rows, int64_t cols, const Fp8QuantizeBatch& batch) {
  return rows >= 0 && cols >= 0 && rows % kTile == 0 && cols % kTile == 0 && batch.count >= 0 &&
         batch.count <= 65535;
}

// `requested` with its zero strides made dense: rows * cols values in and out, and
// `scales_per_entry` scales.
Fp8QuantizeBatch dense_batch(const Fp8QuantizeBatch& requested, int64_t rows, int64_t cols,
                             int64_t scales_per_entry) {
  Fp8QuantizeBatch batch = requested;
  if (batch.in_stride == 0) batch.in_stride = rows * cols;
  if (batch.out_stride == 0) batch.out_stride = rows * cols;
  if (batch.scales_stride == 0) batch.scales_stride = scales_per_entry;
  return batch;
}

// One CTA per 128 x 128 tile of each batch entry.
dim3 tile_grid(int64_t rows, int64_t cols, const Fp8QuantizeBatch& batch) {
  return dim3(static_cast<unsigned>(cols / kTile), static_cast<unsigned>(rows / kTile),
              static_cast<unsigned>(batch.count));
}

}  // namespace

cudaError_t launch_transpose_fp8_blocks(const void* codes, const float* scales, int64_t rows,
                                        int64_t cols, void* out, float* out_scales,
                                        cudaStream_t stream, const Fp8QuantizeBatch& requested) {
  if (!tiled_extents_valid(rows, cols, requested)) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0 || requested.count == 0) return cudaSuccess;
  const Fp8QuantizeBatch batch = dense_batch(requested, rows, cols, rows * cols / (kTile * kTile));
  transpose_fp8_blocks_kernel<<<tile_grid(rows, cols, batch), kThreads, 0, stream>>>(
      static_cast<const uint8_t*>(codes), scales, rows, cols, static_cast<uint8_t*>(out),
      out_scales, batch);
  return cudaGetLastError();
}

cudaError_t launch_gather_quantize_fp8(const Fp8GatherQuantize& params, cudaStream_t stream) {
  if (params.cols <= 0 || params.cols % kTile != 0 || params.capacity_rows < 0 ||
      params.capacity_rows % kTile != 0 || params.header == nullptr ||
      (params.row_pair != nullptr && params.top_k <= 0) ||
      (params.row_codes != nullptr) != (params.row_scales != nullptr) ||
      (params.column_codes != nullptr) != (params.column_scales != nullptr))
    return cudaErrorInvalidValue;
  if (params.capacity_rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(params.cols / kTile),
                  static_cast<unsigned>(params.capacity_rows / kTile));
  gather_quantize_fp8_kernel<<<grid, kThreads, 0, stream>>>(params);
  return cudaGetLastError();
}

cudaError_t launch_quantize_fp8(const void* in, int64_t rows, int64_t cols, Fp8QuantizeForm form,
                                void* out, float* scales, cudaStream_t stream,
                                const Fp8QuantizeBatch& requested) {
  // The blocks: the weights' kernel, one layout.
  if (form == Fp8QuantizeForm::kBlocks)
    return launch_quantize_fp8_blocks_both(in, rows, cols, out, scales, nullptr, nullptr, stream,
                                           requested);
  if (form == Fp8QuantizeForm::kBlocksTransposed)
    return launch_quantize_fp8_blocks_both(in, rows, cols, nullptr, nullptr, out, scales, stream,
                                           requested);
  if (!tiled_extents_valid(rows, cols, requested)) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0 || requested.count == 0) return cudaSuccess;
  const Fp8QuantizeBatch batch = dense_batch(requested, rows, cols, rows * cols / kTile);
  const dim3 grid = tile_grid(rows, cols, batch);
  const auto* source = static_cast<const __nv_bfloat16*>(in);
  auto* codes = static_cast<uint8_t*>(out);
  switch (form) {
    case Fp8QuantizeForm::kRowGroups:
      quantize_fp8_kernel<Fp8QuantizeForm::kRowGroups>
          <<<grid, kThreads, 0, stream>>>(source, rows, cols, codes, scales, batch);
      break;
    case Fp8QuantizeForm::kColumnGroups:
      quantize_fp8_kernel<Fp8QuantizeForm::kColumnGroups>
          <<<grid, kThreads, 0, stream>>>(source, rows, cols, codes, scales, batch);
      break;
    default:
      return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

cudaError_t launch_quantize_fp8_blocks_both(const void* in, int64_t rows, int64_t cols, void* out,
                                            float* scales, void* out_t, float* scales_t,
                                            cudaStream_t stream,
                                            const Fp8QuantizeBatch& requested) {
  if (!tiled_extents_valid(rows, cols, requested) || (out == nullptr) != (scales == nullptr) ||
      (out_t == nullptr) != (scales_t == nullptr))
    return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0 || requested.count == 0) return cudaSuccess;
  const Fp8QuantizeBatch batch = dense_batch(requested, rows, cols, rows * cols / (kTile * kTile));
  quantize_weight_blocks_kernel<<<tile_grid(rows, cols, batch), kThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(in), rows, cols, static_cast<uint8_t*>(out), scales,
      static_cast<uint8_t*>(out_t), scales_t, batch);
  return cudaGetLastError();
}

}  // namespace mok::kernels
