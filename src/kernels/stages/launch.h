// Host-callable launchers of the layer's element-wise stages: the local dispatch, the epoch
// advance, the combine, the SwiGLU backward (dispatch_local.cu, combine.cu, swiglu_backward.cu;
// the schedule's launcher is public: mok/schedule_gpu.h, non_finite_scan.h has its own).
// Pointers are device memory; nothing here synchronizes. Each takes a KernelStream: a stream, or
// {stream, true} to overlap the launch with the previous kernel (kernel_stream.h; every kernel
// here waits for it before touching memory).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/common/kernel_stream.h"
#include "mok/schedule.h"

namespace mok::kernels {

// Local dispatch (dispatch_local.cu): schedule rows [row_begin, row_begin + max_rows), clipped to
// header.total_rows, get x[token of row_pair[row]] (padding rows get zeros), stored at row -
// row_begin of `rows` [max_rows, hidden] (a macrobatch's ring buffer; row_begin 0 and max_rows
// the schedule's max_rows: the whole schedule). `top_k` decodes the pair index.
cudaError_t launch_gather_rows(const ScheduleHeader* header, const int32_t* row_pair, const void* x,
                               int64_t hidden, int32_t top_k, void* rows, int64_t max_rows,
                               KernelStream on, int64_t row_begin = 0);

// The same rows, walked by token (the layer's gather): a warp per token reads x[token] once and
// stores it into each row pair_row[token * top_k + k] inside the window; padding rows get zeros.
// `pair_row` holds num_tokens * top_k entries (-1: not routed here); top_k <= 32. Bitwise the
// same buffer as launch_gather_rows.
cudaError_t launch_gather_rows_by_token(const ScheduleHeader* header, const int32_t* row_pair,
                                        const int32_t* pair_row, const void* x, int64_t num_tokens,
                                        int64_t hidden, int32_t top_k, void* rows, int64_t max_rows,
                                        KernelStream on, int64_t row_begin = 0);

// The L2 partition probe (l2_probe.cu; layer/l2_partitions.h): `num_ctas` CTAs, one per SM
// (each asks for most of an SM's shared memory), each recording its SM id in sm_of_block[b] and
// the SM cycles per dependent atomic add to each of kL2ProbeLines lines of `lines` in
// latency[b * kL2ProbeLines + line]. `lines`: kL2ProbeLines * kL2ProbeLineStrideWords words,
// zeroed.
inline constexpr int32_t kL2ProbeLines = 64;
// Words between probed lines: 36,992 bytes, an odd multiple of 128-byte lines, so the lines fall
// on many L2 slices of both partitions.
inline constexpr int32_t kL2ProbeLineStrideWords = 9248;
cudaError_t launch_l2_probe(uint32_t* lines, uint32_t* latency, int32_t* sm_of_block,
                            int32_t num_ctas, cudaStream_t stream);

// Advances an epoch word by one (the fused local dispatch's after each gate/up GEMM that used
// it, the persistent forward's after each launch): one thread, stream-ordered, CUDA-graph
// capturable.
cudaError_t launch_advance_epoch(unsigned long long* epoch, KernelStream on);

// Combine (combine.cu): out[t] = bf16(shared[t] + sum_k fmaf(w[t,k], row(p))) with p = t*K + k,
// in k order, where row(p) is row index[p] of `expert_rows` for index[p] >= 0, row
// -index[p] - 2 of `local_rows` for index[p] <= -2 (the expert-parallel combine reads the pairs
// of this rank's own experts where the expert GEMM left them: launch_slot_index), and nothing
// for -1. `expert_rows` [rows, H] holds the expert outputs (schedule order, or the slots);
// `shared` may be null; `router_weights` null means weight 1 (the d_x sum: fmaf(1, y, acc) ==
// acc + y exactly).
cudaError_t launch_combine(const void* expert_rows, const int32_t* index, const void* shared,
                           const float* router_weights, int64_t num_tokens, int64_t hidden,
                           int32_t top_k, void* out, KernelStream on,
                           const void* local_rows = nullptr);

// SwiGLU backward (swiglu_backward.cu), one warp per row, over rows [0, header->total_rows) (or
// [0, num_rows) when header is null): from bf16 g, u and dh_raw rows, d_g, d_up and
// h_w = bf16(w h) rows (weighted_hidden may alias dh_raw: each element is read, then written, by
// one thread), and d_router_weights[row_pair[row]] = <dh_raw, h> of the row in the fixed order of
// swiglu_backward.cuh (per 8-column vector, a tree over each 256-column group's 32 vectors, the
// groups in column order). Row r's pair is row_pair[r] (identity when null; -1 = padding,
// weight 0, nothing written to d_router_weights); router_weights null = weight 1;
// d_router_weights may be null (the shared expert). Expert parallel: with
// d_router_weights_peers set, pair p's gradient goes to d_router_weights_peers[p / pairs_per_rank]
// [p % pairs_per_rank] (its source rank's buffer) instead.
// Macrobatch: only rows [row_begin, row_begin + row_count) run, and the row buffers (gate, up,
// dh_raw, d_gate, d_up, weighted_hidden) hold them at row - row_begin (row_pair stays indexed by
// the schedule row).
cudaError_t launch_swiglu_backward(const ScheduleHeader* header, int64_t num_rows, const void* gate,
                                   const void* up, const void* dh_raw, const int32_t* row_pair,
                                   const float* router_weights, int64_t intermediate, float limit,
                                   void* d_gate, void* d_up, void* weighted_hidden,
                                   float* d_router_weights, float* const* d_router_weights_peers,
                                   int32_t pairs_per_rank, KernelStream on, int64_t row_begin = 0,
                                   int64_t row_count = INT64_MAX);

// The router weights' gradients from the per-column-tile partials of the down dgrad's SwiGLU
// epilogue (ExpertGemmForm::kDownGradSwiGLU): for each routed row r of [row_begin, row_begin +
// row_count) ∩ [0, header->total_rows), d_router_weights[row_pair[r]] = ((0 + p_0) + p_1) + ...
// over p_t = partials[t * partial_rows + r - row_begin], t < ceil(intermediate / 256): the
// column order in which the standalone pass adds its 256-column groups, so the same bits.
// d_router_weights_peers and pairs_per_rank as launch_swiglu_backward's.
cudaError_t launch_router_weight_grad_sum(const ScheduleHeader* header, const float* partials,
                                          int64_t partial_rows, const int32_t* row_pair,
                                          int64_t intermediate, float* d_router_weights,
                                          float* const* d_router_weights_peers,
                                          int32_t pairs_per_rank, KernelStream on,
                                          int64_t row_begin = 0, int64_t row_count = INT64_MAX);

}  // namespace mok::kernels
