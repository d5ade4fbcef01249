// Where the layer's device counters live: one layout struct per counter buffer, shared by the
// host runtime (which allocates and zeroes each buffer once and hands the kernels pointers into
// it) and by the CPU tests (tests/cpu/test_counter_layouts.cpp: every region inside the buffer,
// none overlapping). Every counter is a 64-bit word that only grows (epochs: see the kernels),
// so nothing here is ever reset. Offsets are in words.
#pragma once

#include <cstdint>

#include "mok/dtype.h"

namespace mok::kernels {

// A fused gather's counters (dispatch_local.cuh, FusedGather): [0] ticket, [1] epoch, then one
// row count per 128-row tile.
struct GatherCounterLayout {
  int64_t max_tiles = 0;
  MOK_HOST_DEVICE int64_t ticket() const { return 0; }
  MOK_HOST_DEVICE int64_t epoch() const { return 1; }
  MOK_HOST_DEVICE int64_t tile_rows_done() const { return 2; }
  MOK_HOST_DEVICE int64_t words() const { return 2 + max_tiles; }
};

// The persistent forward's counters (forward_gemms.cu, ForwardGemmsParams): [0] ticket,
// [1] epoch, the routed row tiles' gate/up tiles done, then the shared expert's row tiles'.
struct ForwardCounterLayout {
  int64_t max_tiles = 0;     // the routed schedule's worst case
  int64_t shared_tiles = 0;  // ceil(T / 128) with a shared expert, else 0
  MOK_HOST_DEVICE int64_t ticket() const { return 0; }
  MOK_HOST_DEVICE int64_t epoch() const { return 1; }
  MOK_HOST_DEVICE int64_t gate_up_done() const { return 2; }
  MOK_HOST_DEVICE int64_t shared_gate_up_done() const { return 2 + max_tiles; }
  MOK_HOST_DEVICE int64_t words() const { return 2 + max_tiles + shared_tiles; }
};

// The persistent backward's counters (backward_gemms.cu, BackwardGemmsParams): [0] ticket,
// [1] epoch; the routed set's per-row-tile GEMM and SwiGLU counts and per-expert SwiGLU counts;
// the d_out and x gathers its spare warps run (a GatherCounterLayout each); the shared expert's
// set (one expert).
struct BackwardCounterLayout {
  int64_t max_tiles = 0;
  int64_t num_experts = 0;  // local experts
  int64_t shared_tiles = 0;
  MOK_HOST_DEVICE int64_t ticket() const { return 0; }
  MOK_HOST_DEVICE int64_t epoch() const { return 1; }
  MOK_HOST_DEVICE int64_t row_gemms_done() const { return 2; }
  MOK_HOST_DEVICE int64_t swiglu_done() const { return row_gemms_done() + max_tiles; }
  MOK_HOST_DEVICE int64_t expert_ready() const { return swiglu_done() + max_tiles; }
  MOK_HOST_DEVICE GatherCounterLayout gather() const { return {max_tiles}; }
  MOK_HOST_DEVICE int64_t d_out_gather() const { return expert_ready() + num_experts; }
  MOK_HOST_DEVICE int64_t x_gather() const { return d_out_gather() + gather().words(); }
  MOK_HOST_DEVICE int64_t shared_row_gemms_done() const { return x_gather() + gather().words(); }
  MOK_HOST_DEVICE int64_t shared_swiglu_done() const {
    return shared_row_gemms_done() + shared_tiles;
  }
  MOK_HOST_DEVICE int64_t shared_expert_ready() const {
    return shared_swiglu_done() + shared_tiles;
  }
  MOK_HOST_DEVICE int64_t words() const { return shared_expert_ready() + 1; }
};

// An expert-parallel rank's counters (src/comm/ep_exchange.cpp), by index: the routing
// exchange's epoch; the push combine's epoch and CTAs done; the push dispatch's epoch and CTAs
// done. A barrier's (epoch, done) pair sits side by side, as push_rows_args reads it.
enum class EpCounter : int32_t {
  kExchangeEpoch = 0,
  kPushEpoch = 1,
  kPushDone = 2,
  kDispatchEpoch = 3,
  kDispatchDone = 4,
  kCount = 5,
};

}  // namespace mok::kernels
