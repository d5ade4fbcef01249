// The FP8 backward's SwiGLU (swiglu_backward_quantize.cu; issue 17): the bf16 path's SwiGLU
// backward (swiglu_backward.cuh: d_g, d_u, h_w = bf16(w h) per element, d_router_weights per
// row) with its outputs quantized in the same pass for the FP8 GEMMs that read them, so that no
// bf16 d_g, d_u or h_w is written and read back:
//   d_g, d_u  row groups (the gate/up dgrad's A) and column groups (the weight gradients' A)
//   h_w       column groups (the down weight gradient's B)
// The same bits as the three passes it replaces (launch_swiglu_backward, then
// launch_gather_quantize_fp8 on d_g and on d_u, then launch_quantize_fp8's column groups on h_w),
// d_router_weights included: the row's dot is summed per lane in the same order and over the
// lanes with the same xor tree.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/kernel_stream.h"
#include "kernels/gemm/expert_gemm_params.h"
#include "mok/schedule.h"

namespace mok::kernels {

struct Fp8SwigluBackward {
  // gate, up, dh_raw, row_pair, router_weights, vectors_per_row (I / 8), limit and the router
  // gradients' destinations; its bf16 outputs (d_gate, d_up, weighted_hidden) are not written
  // and row_begin must be 0 (one macrobatch, as the FP8 path runs).
  SwigluBackwardArgs swiglu{};
  const ScheduleHeader* header = nullptr;  // rows below total_rows are computed
  int64_t capacity_rows = 0;               // the row buffers' extent, a multiple of 128
  // Row groups [capacity_rows, I] with scales [I/128, capacity_rows] (required).
  void* d_gate_rows = nullptr;
  float* d_gate_row_scales = nullptr;
  void* d_up_rows = nullptr;
  float* d_up_row_scales = nullptr;
  // Column groups, transposed [I, capacity_rows] with scales [capacity_rows/128, I]: all three or
  // none (no weight gradients: frozen weights).
  void* d_gate_columns = nullptr;
  float* d_gate_column_scales = nullptr;
  void* d_up_columns = nullptr;
  float* d_up_column_scales = nullptr;
  void* h_w_columns = nullptr;
  float* h_w_column_scales = nullptr;
};

// One CTA per 128 schedule rows; tiles wholly past total_rows write nothing, the rows of a tile
// past total_rows quantize as zeros (as launch_gather_quantize_fp8 does). cudaErrorInvalidValue
// for I or capacity_rows not a multiple of 128, a missing row output, some column outputs without
// the others, or row_begin != 0.
cudaError_t launch_swiglu_backward_quantize_fp8(const Fp8SwigluBackward& params, KernelStream on);

}  // namespace mok::kernels
