// The GPU quantizers of the FP8 path (issue 17; fp8_quantize.cu): bf16 [rows, cols] row-major to
// e4m3 plus fp32 scales, bit-exact with the host quantizers of mok/fp8.h. Rows and cols are
// multiples of 128 (and a transposition of codes already in blocks, below). Four forms, each the
// operand of one FP8 GEMM (wgmma reads FP8 only K-major):
//   kRowGroups        groups of 128 along each row; out [rows, cols], scales [cols/128, rows]
//                     (activations whose reduction runs along the row: x, h, d_out, d_g, d_u)
//   kColumnGroups     groups of 128 along each column, out transposed [cols, rows], scales
//                     [rows/128, cols] (the weight gradients' operands: their reduction runs
//                     over the rows, the tokens)
// The group forms write their scales group-major (one K-block's 128 row scales contiguous), the
// layout the FP8 GEMM loads per K-block with TMA (gemm/fp8_gemm.h); the host quantizers write
// them [rows, groups].
//   kBlocks           128 x 128 blocks; out [rows, cols], scales [rows/128, cols/128] (weights)
//   kBlocksTransposed the same blocks, out transposed [cols, rows], scales [cols/128, rows/128]
//                     (the weights as the dgrads' K-major operands)
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/kernel_stream.h"
#include "mok/schedule.h"

namespace mok::kernels {

enum class Fp8QuantizeForm : int32_t {
  kRowGroups = 0,
  kColumnGroups = 1,
  kBlocks = 2,
  kBlocksTransposed = 3,
};

// Several matrices of one shape in one launch (the experts' weights): entry b reads `in` +
// b * in_stride bf16 and writes `out` + b * out_stride codes and `scales` + b * scales_stride
// floats; a stride of 0 means the entries are dense (rows * cols, rows * cols, the form's scale
// count).
struct Fp8QuantizeBatch {
  int64_t count = 1;
  int64_t in_stride = 0;
  int64_t out_stride = 0;
  int64_t scales_stride = 0;
};

// `in` bf16 [rows, cols]; `out` e4m3 and `scales` fp32 as the form says. One 256-thread CTA per
// 128 x 128 tile (and batch entry). cudaErrorInvalidValue for extents that are not multiples of
// 128.
cudaError_t launch_quantize_fp8(const void* in, int64_t rows, int64_t cols, Fp8QuantizeForm form,
                                void* out, float* scales, KernelStream on,
                                const Fp8QuantizeBatch& batch = {});

// Weights in 128 x 128 blocks both ways in one pass (a training step's forward: the forward's
// kBlocks and the dgrads' kBlocksTransposed from one read of the bf16): `out` [rows, cols] with
// `scales` [rows/128, cols/128], and `out_t` [cols, rows] with `scales_t` [cols/128, rows/128],
// the bits launch_quantize_fp8 gives for each form. Either pair may be null (that form is
// skipped). The batch's out_stride and scales_stride apply to both.
cudaError_t launch_quantize_fp8_blocks_both(const void* in, int64_t rows, int64_t cols, void* out,
                                            float* scales, void* out_t, float* scales_t,
                                            KernelStream on, const Fp8QuantizeBatch& batch = {});

// The local exchange's FP8 rows, gathered and quantized in one pass, so that no bf16 copy of
// the routed rows is written unless asked for. Schedule row r < header->total_rows is token
// row_pair[r] / top_k's row of `tokens` [T, cols] bf16, or zeros (row_pair[r] < 0: padding).
// Without a row_pair, row r is row r of `tokens` itself ([capacity_rows, cols]): one pass for
// both group forms of rows already in schedule order (d_g, d_u).
// Each output given is written for every row below total_rows, rows past it left as they are:
//   rows_bf16                  [capacity_rows, cols] bf16, the gathered rows themselves
//   row_codes, row_scales      kRowGroups: [capacity_rows, cols], scales [cols/128, capacity_rows]
//   column_codes, column_scales  kColumnGroups: [cols, capacity_rows], scales
//                              [capacity_rows/128, cols]
// The codes and scales are the bits launch_quantize_fp8 gives for the gathered rows. One
// 256-thread CTA per 128 x 128 tile; cols and capacity_rows multiples of 128.
struct Fp8GatherQuantize {
  const ScheduleHeader* header = nullptr;
  const int32_t* row_pair = nullptr;
  int32_t top_k = 0;
  const void* tokens = nullptr;
  int64_t cols = 0;
  int64_t capacity_rows = 0;
  void* rows_bf16 = nullptr;
  void* row_codes = nullptr;
  float* row_scales = nullptr;
  void* column_codes = nullptr;
  float* column_scales = nullptr;
};
cudaError_t launch_gather_quantize_fp8(const Fp8GatherQuantize& params, KernelStream on);

// Pre-quantized weights (ForwardArgs::w_*_fp8) as the dgrads' operands: e4m3 `codes` [rows,
// cols] in 128 x 128 blocks with `scales` [rows/128, cols/128] to `out` [cols, rows] and
// `out_scales` [cols/128, rows/128], the bits kBlocksTransposed writes for the weight they
// came from (a block's amax, and so each code, is the same both ways). Batch strides count
// codes and scales (0: dense). One 256-thread CTA per block and batch entry.
cudaError_t launch_transpose_fp8_blocks(const void* codes, const float* scales, int64_t rows,
                                        int64_t cols, void* out, float* out_scales, KernelStream on,
                                        const Fp8QuantizeBatch& batch = {});

}  // namespace mok::kernels
