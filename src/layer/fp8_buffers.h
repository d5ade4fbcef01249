// The FP8 path's buffers of one expert set (MoeConfig::precision = kFP8Block;
// layer/fp8_stages.cpp fills and reads them). Every operand is e4m3 codes plus fp32 scales in
// the FP8 GEMM's layouts (kernels/gemm/fp8_gemm.h):
//   weights, blocks of 128 x 128, quantized from the bf16 weights (on every call, or once per
//   ForwardArgs::weights_version); a weight given pre-quantized is read where the caller keeps
//   it instead, and only its transposed copy lives here:
//     w_gate, w_up  [E, I, H], scales [E, I/128, H/128]   the forward gate/up GEMM's B and B2
//     w_down        [E, H, I], scales [E, H/128, I/128]   the down GEMM's B
//     w_down_t      [E, I, H] (Wd transposed)             the down dgrad's B
//     w_gate_t, w_up_t [E, H, I] (transposed)             the gate/up dgrad's B and B2
//   activations in 1 x 128 groups along the reduction, scales group-major [width/128, rows]:
//     x_rows, d_out_rows [rows, H]; h, d_gate, d_up [rows, I]
//   the weight gradients' operands, transposed, in groups of 128 rows, scales [rows/128, width]:
//     x_t, d_out_t [H, rows]; d_gate_t, d_up_t, h_w_t [I, rows]
#pragma once

#include <cstdint>
#include <string>

#include "layer/cuda_buffer.h"

namespace mok {

// An FP8 operand where it lives: e4m3 codes and their fp32 scales (a buffer below, or a
// caller's pre-quantized weight, ForwardArgs::w_*_fp8). `codes_stride`: codes from one expert's
// matrix to the next, 0 for dense (a caller's expert-strided view: the gate or up half of a
// fused weight); the scales are dense.
struct Fp8View {
  const void* codes = nullptr;
  const float* scales = nullptr;
  int64_t codes_stride = 0;
  bool present() const { return codes != nullptr; }
};

struct Fp8Operand {
  DeviceBuffer codes;   // e4m3, one byte each
  DeviceBuffer scales;  // fp32
  void allocate(int64_t values, int64_t scale_count, const std::string& what) {
    codes.allocate(values, what + " (e4m3)");
    scales.allocate(scale_count * 4, what + " (scales)");
  }
  float* scale_data() const { return scales.as<float>(); }
  Fp8View view() const { return {codes.pointer, scale_data()}; }
};

// Which weights a set of quantized ones holds (ForwardArgs::weights_version; 0 names none).
struct Fp8WeightKey {
  const void* gate = nullptr;
  const void* up = nullptr;
  const void* down = nullptr;
  uint64_t version = 0;
  bool operator==(const Fp8WeightKey&) const = default;
};

struct Fp8SetBuffers {
  Fp8Operand w_gate, w_up, w_down, w_down_t, w_gate_t, w_up_t;
  // What w_gate, w_up, w_down hold, and what the transposed ones hold (the stages keep them
  // while a call names the same weights; layer/fp8_stages.cpp).
  mutable Fp8WeightKey weights_key, transposed_key;
  // The transposed ones were written by the last forward's pass over the bf16 weights (both
  // layouts at once), for the backward that follows it whatever the version; cleared by that
  // backward and by a forward that quantizes without them.
  mutable bool transposed_by_forward = false;
  Fp8Operand x_rows, d_out_rows, h, d_gate, d_up;
  Fp8Operand x_t, d_out_t, d_gate_t, d_up_t, h_w_t;

  // `rows`, H and I multiples of 128.
  void allocate(int64_t rows, int64_t hidden, int64_t inter, int64_t experts) {
    const int64_t weight = experts * inter * hidden, weight_scales = weight / (128 * 128);
    for (Fp8Operand* w : {&w_gate, &w_up, &w_down, &w_down_t, &w_gate_t, &w_up_t})
      w->allocate(weight, weight_scales, "FP8 weights");
    for (Fp8Operand* a : {&x_rows, &d_out_rows, &x_t, &d_out_t})
      a->allocate(rows * hidden, rows * hidden / 128, "FP8 rows of width H");
    for (Fp8Operand* a : {&h, &d_gate, &d_up, &d_gate_t, &d_up_t, &h_w_t})
      a->allocate(rows * inter, rows * inter / 128, "FP8 rows of width I");
  }
};

}  // namespace mok
