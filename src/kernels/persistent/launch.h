// Host-callable launchers of the persistent forward and backward kernels (forward_gemms.cu,
// backward_gemms.cu). Pointers are device memory; nothing here synchronizes.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/gemm/expert_gemm_params.h"

namespace mok::kernels {

// The persistent forward GEMM kernel (forward_gemms.cu): every gate/up and down tile of the
// forward in one launch of num_ctas CTAs; `epoch` = params.epoch must be advanced after it.
struct ForwardSetMaps {
  CUtensorMap x_rows;      // A of gate/up: the gathered x rows [rows, H], [128 x 64] boxes
  CUtensorMap w_gate;      // [E_loc, I, H], [128 x 64] boxes
  CUtensorMap w_up;        // likewise
  CUtensorMap hidden_in;   // A of down: h [rows, I], [128 x 64] boxes
  CUtensorMap w_down;      // [E_loc, H, I], [128 x 64] boxes (two per 256-row tile)
  CUtensorMap hidden_out;  // stores, [1, rows, N] maps with [128 rows x 64] boxes: h,
  CUtensorMap gate_out;    // bf16(g), bf16(u) (the forward context),
  CUtensorMap up_out;
  CUtensorMap y_out;  // and the expert output rows [rows, H]
};
// The routed experts' maps, and the shared expert's (x itself as its rows, one expert, Is; used
// when params.shared_m_tiles > 0).
struct ForwardGemmsMaps {
  ForwardSetMaps routed;
  ForwardSetMaps shared;
};
cudaError_t launch_forward_gemms(const ForwardGemmsMaps& maps, const ForwardGemmsParams& params,
                                 int num_ctas, cudaStream_t stream);

// The persistent backward kernel (backward_gemms.cu): every recompute, down dgrad, SwiGLU,
// gate/up dgrad and weight-gradient task of the routed experts' backward (and of the shared
// expert's, params.num_sets = 2) in one launch of num_ctas CTAs (one macrobatch; the rows
// gathered before it or by its spare warps, the d_x combine after it); params.epoch must be
// advanced after it. Maps of one expert set, as the standalone forms read and store them.
struct BackwardSetMaps {
  CUtensorMap x_rows;        // recompute A: x rows [rows, H], K-major [128 x 64] boxes
  CUtensorMap w_gate, w_up;  // recompute B: [E_loc, I, H], K-major [128 x 64] boxes
  CUtensorMap gate_out;      // stores: bf16(g) and bf16(u) [rows, I]
  CUtensorMap up_out;
  CUtensorMap d_out_rows;    // down dgrad A: d_out rows [rows, H], K-major
  CUtensorMap w_down_mn;     // down dgrad B: [E_loc, H, I] read MN-major
  CUtensorMap dh_out;        // store: dh_raw [rows, I] (the SwiGLU task turns it into h_w)
  CUtensorMap d_gate, d_up;  // gate/up dgrad A: [rows, I], K-major
  CUtensorMap w_gate_mn;     // gate/up dgrad B: [E_loc, I, H] read MN-major
  CUtensorMap w_up_mn;
  CUtensorMap dx_out;     // store: the dx rows [rows, H]
  CUtensorMap d_gate_mn;  // weight-gradient A operands [rows, M], MN-major
  CUtensorMap d_up_mn;
  CUtensorMap d_out_mn;
  CUtensorMap x_mn;  // weight-gradient B operands [rows, N], MN-major
  CUtensorMap h_w_mn;
  CUtensorMap d_w_gate;  // stores [E_loc, M, N]
  CUtensorMap d_w_up;
  CUtensorMap d_w_down;
  // The SwiGLU task's loads (swiglu_backward_task.cuh): g, u, dh_raw [rows, I] in [32 x 64]
  // boxes.
  CUtensorMap swiglu_gate, swiglu_up, swiglu_dh;
};
struct BackwardGemmsMaps {
  BackwardSetMaps sets[2];  // the routed experts', the shared expert's
};
cudaError_t launch_backward_gemms(const BackwardGemmsMaps& maps, const BackwardGemmsParams& params,
                                  int num_ctas, cudaStream_t stream);

}  // namespace mok::kernels
