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
  // Each row's router-weight gradient over each 256-column group of I, fp32
  // [ceil(I / 256)][capacity_rows] (the layout launch_router_weight_grad_sum reads). Given, the
  // launcher may split a row tile's I over several CTAs, each a run of groups, which leave their
  // groups' sums here; launch_router_weight_grad_sum then adds them in the standalone pass's
  // order, so d_router_weights keeps its bits. Null: where router gradients are wanted, one CTA
  // per row tile, which sums its rows' groups itself.
  float* router_grad_partials = nullptr;
  // CTAs per row tile: 0 lets the launcher choose (swiglu_backward_quantize_splits); more than
  // the groups is cut to them. Where router gradients are wanted without partials, always 1.
  int32_t column_splits = 0;
};

// The CTAs per row tile that finish the pass soonest. The row tiles' CTAs run in waves of
// `slots` (CTAs resident at once); a CTA takes its run of the `groups` 256-column groups plus a
// fixed start worth an eighth of a group (its rows' pairs and weights, its first loads). Only
// splits that divide the groups evenly are weighed; ties go to fewer. At dsv3_local (~288 row
// tiles of 8 groups, 264 slots on 132 SMs) one CTA per tile leaves a second wave of ~24 CTAs
// (the pass moved 1.15 TB/s there against 1.71 at qwen3, session 36); eight CTAs a tile run
// nine short waves. At qwen3 (512 tiles of 3 groups) one CTA a tile stays.
inline int32_t swiglu_backward_quantize_splits(int64_t row_tiles, int32_t groups, int64_t slots) {
  if (row_tiles <= 0 || groups <= 1 || slots <= 0) return 1;
  int32_t best = 1;
  double best_cost = 0.0;
  for (int32_t splits = 1; splits <= groups; ++splits) {
    if (groups % splits != 0) continue;
    const int64_t waves = (row_tiles * splits + slots - 1) / slots;
    const double cost = static_cast<double>(waves) * (groups / splits + 0.125);
    if (splits == 1 || cost < best_cost) {
      best = splits;
      best_cost = cost;
    }
  }
  return best;
}

// One CTA per 128 schedule rows and run of I's 256-column groups (router_grad_partials,
// column_splits), then, with partials in use, launch_router_weight_grad_sum; tiles wholly past
// total_rows write nothing, the rows of a tile past total_rows quantize as zeros (as
// launch_gather_quantize_fp8 does). cudaErrorInvalidValue for I or capacity_rows not a multiple
// of 128, a missing row output, some column outputs without the others, row_begin != 0 or
// column_splits < 0.
cudaError_t launch_swiglu_backward_quantize_fp8(const Fp8SwigluBackward& params, KernelStream on);

}  // namespace mok::kernels
