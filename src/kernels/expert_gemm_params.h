// Parameters of the expert grouped GEMMs, shared by the host launcher and the kernels (plain
// data: included by host C++ too).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/wait_types.h"
#include "mok/schedule.h"

namespace mok::kernels {

// Which GEMM of the layer, and so which operand loads and which epilogue.
enum class ExpertGemmForm : int32_t {
  // h = swiglu(x_rows * Wg[e]^T, x_rows * Wu[e]^T): A = gathered rows [rows, H], B = gate and
  // up weights [E_loc, I, H]; a tile is 128 rows x (128 gate + 128 up) columns; out = h [rows, I].
  kGateUpSwiGLU = 0,
  // y = h * Wd[e]^T, rounded to bf16 and scattered: row `r` goes to combine slot row_pair[r]
  // (the pair index (src, token, k)); padding rows are dropped. A = h [rows, I], B = Wd [E_loc, H, I].
  kDownScatter = 1,
};

struct ExpertGemmParams {
  const ScheduleHeader* header;  // num_tiles: how many 128-row tiles the schedule filled
  const int32_t* tile_expert;    // local expert of each 128-row tile
  const int32_t* row_pair;       // pair index of each row, -1 = padding
  int32_t n_extent;              // output columns: I (gate/up) or H (down)
  int32_t k_extent;              // reduction length: H (gate/up) or I (down)
  __nv_bfloat16* out;            // h [max_rows, I] or combine slots [pairs, H]
  int64_t out_ld;                // elements between output rows
  float swiglu_limit;            // infinity = no clamp
  WaitContext wait;
};

// Output columns covered by one tile of the form.
constexpr int tile_n_columns(ExpertGemmForm form) {
  return form == ExpertGemmForm::kGateUpSwiGLU ? 128 : 256;
}

}  // namespace mok::kernels
