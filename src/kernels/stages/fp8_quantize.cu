// The FP8 quantizers (fp8_quantize.h), bit-exact with mok/fp8.h's host quantizers, and the
// transposition of pre-quantized weight blocks. The gathered rows' pass has its own file
// (fp8_gather_quantize.cu).
//
// Grid: one 256-thread CTA per 128 x 128 tile of the input.
// - Row and column groups (quantize_fp8_kernel): thread t loads its 8 x 8 block of the tile
//   (fp8_register_block.cuh: rows 8 (t / 16) + k, columns 8 (t % 16) + j) straight into
//   registers, eight 16-byte loads in flight (a warp's load reads two whole 256-byte row
//   slices), and the groups are written from the blocks: the row groups with no shared memory,
//   the column groups through a 16 KB code tile, as the gathered rows' pass does.
// - The weights' blocks (quantize_weight_blocks_kernel): one block per CTA, loaded straight into
//   registers, its amax the CTA's (bf16 pairs, shuffles, the 8 warps through shared memory), and
//   both layouts written in one pass when asked: the codes as they are, whole 128-byte lines per
//   warp store, and transposed through a shared-memory tile of codes, whole lines again.
// Every maximum propagates NaN, as the host's does. The factors come from fp8_group_scale
// (mok/fp8.h: two IEEE divisions), each value is multiplied by the inverse scale in fp32 (a power
// of two: exact), and the conversion is the hardware's cvt.rn.satfinite.e4m3x2.f32.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "kernels/common/overlapped_launch.h"
#include "kernels/common/ptx.cuh"
#include "kernels/stages/fp8_group_tile.cuh"
#include "kernels/stages/fp8_quantize.h"
#include "kernels/stages/fp8_register_block.cuh"
#include "mok/fp8.h"

namespace mok::kernels {

namespace {

using namespace fp8_tile;  // the code tile, codes8 and the amax helpers (fp8_group_tile.cuh)

template <Fp8QuantizeForm kForm>
__global__ void __launch_bounds__(kThreads)
    quantize_fp8_kernel(const __nv_bfloat16* in, int64_t rows, int64_t cols, uint8_t* out,
                        float* scales, Fp8QuantizeBatch batch) {
  static_assert(kForm == Fp8QuantizeForm::kRowGroups || kForm == Fp8QuantizeForm::kColumnGroups,
                "the blocks: quantize_weight_blocks_kernel");
  namespace blocks = fp8_register_block;
  ptx::begin_after_previous_kernel();
  in += blockIdx.z * batch.in_stride;
  out += blockIdx.z * batch.out_stride;
  scales += blockIdx.z * batch.scales_stride;
  const int64_t tile_col = blockIdx.x, tile_row = blockIdx.y;
  const int64_t row0 = tile_row * kTile + blocks::block_row() * blocks::kBlock;
  const int64_t col0 = tile_col * kTile + blocks::block_column() * blocks::kBlock;
  blocks::Block block;
#pragma unroll
  for (int k = 0; k < blocks::kBlock; ++k)
    block[k] = __ldg(reinterpret_cast<const uint4*>(in + (row0 + k) * cols + col0));
  if constexpr (kForm == Fp8QuantizeForm::kRowGroups) {
    blocks::write_row_groups(block, tile_row, tile_col, rows, cols, out, scales);
  } else {
    __shared__ __align__(16) blocks::ColumnGroupsShared shared;
    blocks::write_column_groups(block, tile_row, tile_col, rows, cols, out, scales, shared.scratch,
                                shared.codes);
  }
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
  ptx::begin_after_previous_kernel();
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
  for (int i = 0; i < 8; ++i) row_codes[i] = codes8(loaded[i], inverse);
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

// One 128 x 128 block of codes transposed through shared memory: 16-byte loads of its rows,
// then each thread gathers 64 bytes of one column (half a line of the output) and writes them
// as four 16-byte stores.
__global__ void __launch_bounds__(kThreads)
    transpose_fp8_blocks_kernel(const uint8_t* codes, const float* scales, int64_t rows,
                                int64_t cols, uint8_t* out, float* out_scales,
                                Fp8QuantizeBatch batch) {
  ptx::begin_after_previous_kernel();
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
                                        int64_t cols, void* out, float* out_scales, KernelStream on,
                                        const Fp8QuantizeBatch& requested) {
  if (!tiled_extents_valid(rows, cols, requested)) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0 || requested.count == 0) return cudaSuccess;
  const Fp8QuantizeBatch batch = dense_batch(requested, rows, cols, rows * cols / (kTile * kTile));
  return launch_maybe_overlapped(transpose_fp8_blocks_kernel, tile_grid(rows, cols, batch),
                                 kThreads, 0, on, 1, static_cast<const uint8_t*>(codes), scales,
                                 rows, cols, static_cast<uint8_t*>(out), out_scales, batch);
}

cudaError_t launch_quantize_fp8(const void* in, int64_t rows, int64_t cols, Fp8QuantizeForm form,
                                void* out, float* scales, KernelStream on,
                                const Fp8QuantizeBatch& requested) {
  // The blocks: the weights' kernel, one layout.
  if (form == Fp8QuantizeForm::kBlocks)
    return launch_quantize_fp8_blocks_both(in, rows, cols, out, scales, nullptr, nullptr, on,
                                           requested);
  if (form == Fp8QuantizeForm::kBlocksTransposed)
    return launch_quantize_fp8_blocks_both(in, rows, cols, nullptr, nullptr, out, scales, on,
                                           requested);
  if (!tiled_extents_valid(rows, cols, requested)) return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0 || requested.count == 0) return cudaSuccess;
  const Fp8QuantizeBatch batch = dense_batch(requested, rows, cols, rows * cols / kTile);
  const dim3 grid = tile_grid(rows, cols, batch);
  const auto* source = static_cast<const __nv_bfloat16*>(in);
  auto* codes = static_cast<uint8_t*>(out);
  switch (form) {
    case Fp8QuantizeForm::kRowGroups:
      return launch_maybe_overlapped(quantize_fp8_kernel<Fp8QuantizeForm::kRowGroups>, grid,
                                     kThreads, 0, on, 1, source, rows, cols, codes, scales, batch);
    case Fp8QuantizeForm::kColumnGroups:
      return launch_maybe_overlapped(quantize_fp8_kernel<Fp8QuantizeForm::kColumnGroups>, grid,
                                     kThreads, 0, on, 1, source, rows, cols, codes, scales, batch);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_quantize_fp8_blocks_both(const void* in, int64_t rows, int64_t cols, void* out,
                                            float* scales, void* out_t, float* scales_t,
                                            KernelStream on, const Fp8QuantizeBatch& requested) {
  if (!tiled_extents_valid(rows, cols, requested) || (out == nullptr) != (scales == nullptr) ||
      (out_t == nullptr) != (scales_t == nullptr))
    return cudaErrorInvalidValue;
  if (rows == 0 || cols == 0 || requested.count == 0) return cudaSuccess;
  const Fp8QuantizeBatch batch = dense_batch(requested, rows, cols, rows * cols / (kTile * kTile));
  return launch_maybe_overlapped(quantize_weight_blocks_kernel, tile_grid(rows, cols, batch),
                                 kThreads, 0, on, 1, static_cast<const __nv_bfloat16*>(in), rows,
                                 cols, static_cast<uint8_t*>(out), scales,
                                 static_cast<uint8_t*>(out_t), scales_t, batch);
}

}  // namespace mok::kernels
