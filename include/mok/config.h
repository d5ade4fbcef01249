// Tuning knobs of the fused layer. None of them changes the result: outputs are bitwise
// identical for every valid config (DESIGN.md section 7).
#pragma once

#include <cstdint>

#include "mok/error.h"
#include "mok/shape.h"

namespace mok {

enum class Precision : int32_t {
  kBF16 = 0,  // bf16 operands, fp32 accumulation
  kFP8 = 1,   // reserved: not implemented yet
};

const char* precision_name(Precision precision);

struct MoeConfig {
  int32_t fwd_num_comm_sms = 24;     // SMs that run dispatch/combine in the forward kernel
  int32_t bwd_num_comm_sms = 24;     // likewise in the backward kernel
  int64_t minibatch_size = 4096;     // rows of the expert-grouped buffer per overlap step
  int64_t macrobatch_size = 131072;  // rows of the ring token buffer
  Precision precision = Precision::kBF16;
  double wait_timeout_s = 100.0;  // device spin-waits abort with a diagnosis after this long
  // Run the forward's local dispatch (the gather of routed x rows) inside the gate/up GEMM, on
  // the producer warpgroup's spare warps, instead of as its own kernel before it. Same bits
  // either way; off by default because it measured slower at dsv3 shapes (docs/perf.md, v5).
  bool fuse_local_dispatch = false;
};

inline constexpr int32_t kMaxCommSms = 128;

// Checks the config against the shape it will run; the message names the knob and its value.
Status can_implement(const MoeConfig& config, const MoeShape& shape);

}  // namespace mok
