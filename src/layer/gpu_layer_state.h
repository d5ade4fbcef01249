// The GPU layer's internal state and its expert stages, shared by gpu_layer.cpp (the
// single-GPU sequence and the API), expert_stages.cpp (the GEMM launches of one expert set)
// and ep_layer.cpp (the expert-parallel group). Not a public header.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <functional>

#include "kernels/gemm/launch.h"
#include "kernels/persistent/launch.h"
#include "kernels/stages/launch.h"
#include "layer/cuda_buffer.h"
#include "mok/gpu_layer.h"
#include "mok/layer_args.h"
#include "mok/schedule.h"

namespace mok {

inline int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

struct EpRank;  // one rank's share of an expert-parallel group (ep_layer.cpp)

// One set of experts that runs through the GEMM kernels: the routed experts (schedule built on
// every call) or the shared expert (a fixed one-expert schedule over the rank's tokens).
struct ExpertSet {
  ScheduleLayout layout;
  DeviceBuffer schedule;
  int64_t num_experts = 0;
  int64_t intermediate = 0;
  int64_t capacity_rows = 0;  // rows of the [rows, I] buffers (a multiple of 128)
  DeviceBuffer hidden;        // forward h; backward dh_raw, then h_w in place
  DeviceBuffer gate, up;      // backward: recomputed bf16 g, u
  DeviceBuffer d_gate, d_up;  // backward

  void allocate(int64_t rows, int64_t inter, int64_t experts) {
    capacity_rows = rows;
    intermediate = inter;
    num_experts = experts;
    for (DeviceBuffer* buffer : {&hidden, &gate, &up, &d_gate, &d_up})
      buffer->allocate(rows * inter * 2, "expert buffer");
  }
  ScheduleView view() const { return ScheduleView::at(schedule.pointer, layout); }
  int64_t bytes() const {
    return schedule.bytes + hidden.bytes + gate.bytes + up.bytes + d_gate.bytes + d_up.bytes;
  }
};

struct GpuLayer::State {
  MoeShape shape;
  MoeConfig config;
  int device = 0;
  int sm_count = 0;
  ExpertSet routed, shared;
  // The macrobatch ring (kernels/macrobatch.h): the routed rows, g, u, h, d_out rows, d_g and d_u
  // of one macrobatch of ring_rows schedule rows at a time (routed.capacity_rows = ring_rows);
  // with ring_rows = max_rows (MoeConfig::macrobatch_size >= max_rows) one macrobatch is all.
  int64_t ring_rows = 0;
  int32_t num_macrobatches = 1;  // launched by the host: ceil(max_rows / ring_rows)
  // Weight-gradient accumulators across macrobatch boundaries: 3 matrices x 2 slots x
  // partial_floats fp32 (only with more than one macrobatch).
  DeviceBuffer wgrad_partials;
  int64_t partial_floats = 0;
  DeviceBuffer rows;        // [ring_rows, H]: routed x rows in schedule order (padding rows zero)
  DeviceBuffer d_out_rows;  // [ring_rows, H]: routed d_out rows (backward)
  DeviceBuffer expert_out;  // [max_rows, H]: expert output rows / backward dx rows, schedule order
  DeviceBuffer shared_out;  // [T, H]: the shared expert's output (forward) or dx (backward)
  // The fused local dispatch's counters (dispatch_local.cuh): [0] ticket, [1] epoch,
  // [2 .. 2 + max_tiles) per-tile row counts; zeroed once, never reset (epochs).
  DeviceBuffer gather_state;
  // The persistent forward's counters (forward_gemms.cu): [0] ticket, [1] epoch,
  // [2 .. 2 + max_tiles) gate/up tiles done per row tile; zeroed once, never reset (epochs).
  DeviceBuffer persistent_state;
  // The persistent backward's counters (backward_gemms.cu): [0] ticket, [1] epoch, then per row
  // tile the GEMM tiles done and the SwiGLU task done, then per expert the SwiGLU tasks done,
  // then the d_out and the x gathers' (ticket, epoch, per row tile); zeroed once, never reset
  // (epochs).
  DeviceBuffer persistent_backward_state;
  // The task traces of the latest persistent forward and backward launch (MoeConfig::trace_tasks;
  // TaskTraceEvent by ticket, room for the most tickets a launch can have; 0xff bytes = empty).
  DeviceBuffer forward_trace, backward_trace;
  int64_t forward_trace_capacity = 0, backward_trace_capacity = 0;
  // MoeConfig::check_finite: the first non-finite input found since the last synchronize
  // (kernels/non_finite_scan.h; kNoNonFinite when none). Allocated only with check_finite.
  DeviceBuffer non_finite_record;
  kernels::WaitDiagnosis* diagnosis = nullptr;  // mapped pinned host memory
  kernels::WaitDiagnosis* diagnosis_device = nullptr;
  uint64_t generation = 0;  // forwards run so far: names the context the workspace holds
  int32_t rank = 0;         // in the expert-parallel group (0 of 1 on its own)
  EpRank* ep = nullptr;     // the group's buffers when num_ranks > 1 (owned by the EpLayer)

  ~State() {
    if (diagnosis != nullptr) cudaFreeHost(diagnosis);
  }

  kernels::WaitContext wait_context() const {
    return {static_cast<uint64_t>(config.wait_timeout_s * 1e9), rank, diagnosis_device};
  }

  // Macrobatch m of the routed experts: its tiles, its ring base; `matrix` (0 gate, 1 up,
  // 2 down) picks the weight-gradient partial slots. With one macrobatch: everything, no slices.
  kernels::MacrobatchParams macrobatch(int32_t m, int matrix = 0) const {
    kernels::MacrobatchParams params;
    if (num_macrobatches == 1) return params;
    params.tile_begin = static_cast<int32_t>(m * ring_rows / kDefaultRowAlign);
    params.tile_end = static_cast<int32_t>((m + 1) * ring_rows / kDefaultRowAlign);
    params.ring_row_base = static_cast<int32_t>(m * ring_rows);
    params.out_row_base = params.ring_row_base;
    params.index = m;
    params.rows = ring_rows;
    float* slots = wgrad_partials.as<float>() + static_cast<int64_t>(matrix) * 2 * partial_floats;
    params.partial[0] = slots;
    params.partial[1] = slots + partial_floats;
    return params;
  }
};

using StageMarker = std::function<void(const char*)>;

struct WeightGrads {
  void* d_w_gate;
  void* d_w_up;
  void* d_w_down;
};

namespace stages {

// Forward of one expert set (expert_stages.cpp): h = swiglu(rows Wg^T, rows Wu^T) (keeping g
// and u, the forward context), then y = h Wd^T in schedule order into `out` [out_rows, H].
// `macrobatch` (the routed experts' State::macrobatch(m); default: all rows) picks the tiles;
// `rows` and the set's buffers then hold that macrobatch's rows, `out` stays full size.
void forward_experts(const GpuLayer::State& s, const ExpertSet& set, const void* rows,
                     int64_t rows_in_map, const void* w_gate, const void* w_up, const void* w_down,
                     void* out, int64_t out_rows, const kernels::FusedGather& gather,
                     cudaStream_t stream, const StageMarker& mark,
                     const kernels::MacrobatchParams& macrobatch = {});
// The shared expert's forward inputs and output, for a persistent launch that carries its tiles.
struct SharedExpertForward {
  const void* x = nullptr;  // [T, H]: its rows are the tokens themselves
  const void* w_gate = nullptr;
  const void* w_up = nullptr;
  const void* w_down = nullptr;
  void* out = nullptr;  // [T, H]
};
// The shared expert's backward inputs and outputs, for a persistent backward launch that
// carries its tasks.
struct SharedExpertBackward {
  const void* x = nullptr;      // [T, H]
  const void* d_out = nullptr;  // [T, H]
  const void* w_gate = nullptr;
  const void* w_up = nullptr;
  const void* w_down = nullptr;
  void* dx_out = nullptr;  // [T, H]: its dx rows, for the d_x combine
  WeightGrads grads{};
};
// The same as one persistent kernel (MoeConfig::persistent_forward), one launch per macrobatch;
// with `shared`, the launch also runs the shared expert's tiles (s.shared) after the routed ones.
void forward_experts_persistent(const GpuLayer::State& s, const ExpertSet& set, const void* rows,
                                int64_t rows_in_map, const void* w_gate, const void* w_up,
                                const void* w_down, void* out, int64_t out_rows,
                                const kernels::FusedGather& gather, cudaStream_t stream,
                                const StageMarker& mark,
                                const kernels::MacrobatchParams& macrobatch,
                                const SharedExpertForward* shared = nullptr);
// Backward of one expert set; see expert_stages.cpp. `d_router_weights_peers` (optional, with
// pairs_per_rank): the SwiGLU backward writes each pair's router-weight gradient to its source
// rank's buffer instead of d_router_weights.
// `macrobatch_index` < 0: one pass over all rows; else macrobatch m of the routed experts (the
// weight gradients continue across macrobatches through the partial slots).
void backward_experts(const GpuLayer::State& s, const ExpertSet& set, const void* rows,
                      const void* d_out_rows, int64_t rows_in_map, const void* w_gate,
                      const void* w_up, const void* w_down, const float* router_weights,
                      float* d_router_weights, float* const* d_router_weights_peers,
                      int32_t pairs_per_rank, void* dx_out, int64_t dx_rows,
                      const WeightGrads& grads, bool recompute, cudaStream_t stream,
                      const StageMarker& mark, int32_t macrobatch_index = -1);
// The same as one persistent kernel (MoeConfig::persistent_backward; one macrobatch): the rows
// and d_out rows are gathered inside it by the gathers whose `x` is set, else before it; the
// d_x combine runs after it.
void backward_experts_persistent(
    const GpuLayer::State& s, const ExpertSet& set, const void* rows, const void* d_out_rows,
    int64_t rows_in_map, const void* w_gate, const void* w_up, const void* w_down,
    const float* router_weights, float* d_router_weights, float* const* d_router_weights_peers,
    int32_t pairs_per_rank, void* dx_out, int64_t dx_rows, const WeightGrads& grads, bool recompute,
    const kernels::FusedGather& d_out_gather, const kernels::FusedGather& x_gather,
    cudaStream_t stream, const StageMarker& mark, const SharedExpertBackward* shared = nullptr);

}  // namespace stages

// The expert-parallel steps of the layer (ep_layer.cpp), called by run_forward / run_backward
// when s.ep is set. Every rank of the group must run the same sequence of layer calls: the
// steps signal and wait for every other rank.
namespace ep {

// All-gathers the routing and router weights, builds this rank's schedule, and brings every
// rank's routed x rows here (one NVLink crossing per (token, rank)): pulled from the published
// inputs, or pushed by their ranks (MoeConfig::ep_push_dispatch).
void dispatch_forward(GpuLayer::State& s, const ForwardArgs& args, cudaStream_t stream,
                      const StageMarker& mark);
// Expands the received x rows (d_out rows with `d_out`) of schedule rows [row_begin, row_begin +
// row_count) into `rows` (a macrobatch's ring buffer; the whole schedule with one macrobatch);
// this rank's own rows come from `local_source` (its x or d_out), which no dispatch copies.
void expand_received(GpuLayer::State& s, bool d_out, const void* local_source, void* rows,
                     int64_t row_begin, int64_t row_count, cudaStream_t stream);
// Zeroes this rank's router-weight gradients, exchanges the routing again without a context
// (else a plain barrier), and brings the d_out rows here (and the x rows without a context;
// with one, the forward's received x rows are kept).
void dispatch_backward(GpuLayer::State& s, const BackwardArgs& args, bool use_context,
                       cudaStream_t stream, const StageMarker& mark);
// Pushes s.expert_out's rows into their source ranks' slots and waits for every rank's pushes.
void push_rows(GpuLayer::State& s, cudaStream_t stream, const StageMarker& mark, const char* name);
// The fixed-order sum of this rank's slots (weights null = 1) with the shared expert's rows.
void combine_slots(GpuLayer::State& s, const TensorView& top_experts, const void* shared,
                   const float* weights, void* out, cudaStream_t stream);
// The router weights of every rank's pairs [R*T*K] (gathered by the forward's exchange).
const float* gathered_router_weights(const GpuLayer::State& s);
// Each rank's router-weight gradient buffer [T*K] (symmetric), for the SwiGLU backward.
float* const* router_weight_grad_peers(const GpuLayer::State& s);
// Copies this rank's gathered router-weight gradients into the caller's tensor.
void copy_router_weight_grads(GpuLayer::State& s, const TensorView& d_router_weights,
                              cudaStream_t stream);

}  // namespace ep
}  // namespace mok
