// The macrobatch ring (DESIGN.md §2.6) as plain arithmetic that host and device share, like
// task_order.h: the layer (gpu_layer.cpp), the GEMM kernels (expert_gemm.cu) and the CPU test
// (tests/cpu/test_macrobatch.cpp) follow it.
//
// Rows of the schedule are cut into macrobatches of M rows (a multiple of the 128-row tile), and
// the routed intermediates of one macrobatch (gathered x rows, g, u, h, d_out rows, d_g, d_u)
// live in ring buffers of M rows. The expert output rows (y forward, dx backward) and the
// schedule stay full size. How many macrobatches hold rows is known only on the GPU (the
// schedule's total_rows), so the host launches the most there can be (ceil(max_rows / M)) and
// a macrobatch past total_rows does nothing: no CPU-GPU handshake about sizes.
//
// Order: the forward walks macrobatches from the last to 0, so macrobatch 0's rows, g and u
// are what the ring holds when it ends (the forward context); the backward walks 0 to the last,
// starting from those (recomputing them without a context) and recomputing every other
// macrobatch's gather and gate/up before its own steps.
//
// Weight gradients: the reduction over an expert's rows runs in row order, in fp32, by one CTA
// per output tile. When an expert's segment crosses a macrobatch boundary, the tile's fp32
// accumulator is stored at the end of one macrobatch and loaded at the start of the next, so the
// sum is computed in the same order as in one pass: the bits do not depend on M. A boundary
// cuts at most one segment, so two partial slots per weight matrix suffice: macrobatch m stores
// into slot m % 2 and loads from slot (m - 1) % 2 (the expert it loads for and the one it stores
// for may differ, and run in different CTAs of the same launch). An expert with no rows still
// gets its zero gradient stored once, in macrobatch 0.
#pragma once

#include <stdint.h>

#include "mok/dtype.h"

namespace mok::kernels {

// Macrobatches that hold rows when the schedule filled `total_rows` rows (0 rows: none).
MOK_HOST_DEVICE inline int32_t macrobatches_used(int64_t total_rows, int64_t macrobatch_rows) {
  return static_cast<int32_t>((total_rows + macrobatch_rows - 1) / macrobatch_rows);
}

// Row range [begin, end) of macrobatch m, clipped to the rows the schedule filled (empty past
// them). Tiles: [begin / 128, end / 128), since both are multiples of the tile height.
struct RowRange {
  int64_t begin, end;
};
MOK_HOST_DEVICE inline RowRange macrobatch_rows(int32_t m, int64_t macrobatch_rows,
                                                int64_t total_rows) {
  const int64_t begin = static_cast<int64_t>(m) * macrobatch_rows;
  const int64_t end = begin + macrobatch_rows < total_rows ? begin + macrobatch_rows : total_rows;
  return {begin < end ? begin : end, end};
}

// What the weight-gradient tiles of one expert do in macrobatch m: reduce rows [k_begin, k_end)
// (global row indices; the ring holds them at row - m * M), after loading the fp32 accumulator
// from partial slot load_slot (if load_partial), then store the final bf16 gradient (store_final)
// or the fp32 accumulator into slot store_slot.
struct WeightGradSlice {
  bool active;  // the expert's tiles run in this macrobatch
  int64_t k_begin, k_end;
  bool load_partial;
  int32_t load_slot;
  bool store_final;
  int32_t store_slot;  // when !store_final
};

// `segment_begin`, `segment_end`: the expert's rows [expert_offsets[e], expert_offsets[e + 1]).
MOK_HOST_DEVICE inline WeightGradSlice weight_grad_slice(int64_t segment_begin, int64_t segment_end,
                                                         int32_t m, int64_t macrobatch_rows) {
  WeightGradSlice slice{false, 0, 0, false, 0, false, 0};
  if (segment_end <= segment_begin) {  // no rows: its zero gradient, once
    slice.active = m == 0;
    slice.k_begin = slice.k_end = segment_begin;
    slice.store_final = true;
    return slice;
  }
  const int64_t first = segment_begin / macrobatch_rows;
  const int64_t last = (segment_end - 1) / macrobatch_rows;
  if (m < first || m > last) return slice;
  const int64_t begin = static_cast<int64_t>(m) * macrobatch_rows;
  slice.active = true;
  slice.k_begin = segment_begin > begin ? segment_begin : begin;
  slice.k_end = segment_end < begin + macrobatch_rows ? segment_end : begin + macrobatch_rows;
  slice.load_partial = m > first;
  slice.load_slot = (m + 1) % 2;  // (m - 1) % 2 for m >= 1
  slice.store_final = m == last;
  slice.store_slot = m % 2;
  return slice;
}

}  // namespace mok::kernels
