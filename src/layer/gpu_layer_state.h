// The GPU layer's internal state and its expert stages, shared by gpu_layer.cpp (the API and
// the layer's pipeline), layer_state.cpp (the workspace), expert_stages.cpp (the GEMM launches
// of one expert set), expert_engine.cpp (how they run: kernel sequences or persistent kernels)
// and the token exchanges (local_exchange.cpp; the expert-parallel one in src/comm/). Not a
// public header.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <functional>
#include <memory>

#include "kernels/common/counter_layouts.h"
#include "kernels/common/kernel_stream.h"
#include "kernels/common/wait_types.h"
#include "kernels/gemm/expert_gemm_params.h"
#include "layer/cuda_buffer.h"
#include "layer/fp8_buffers.h"
#include "mok/gpu_layer.h"
#include "mok/layer_args.h"
#include "mok/schedule.h"

namespace mok {

inline int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

class TokenExchange;   // layer/token_exchange.h
class ForwardEngine;   // layer/expert_engine.h
class BackwardEngine;  // layer/expert_engine.h

using StageMarker = std::function<void(const char*)>;

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
  DeviceBuffer d_gate, d_up;  // bf16 backward (FP8 writes d_g and d_u as codes only)
  // Each row's router-weight gradient over each 256-column tile of I, fp32
  // [ceil(I / 256)][capacity_rows], summed after the kernel that leaves them: the down dgrad's
  // SwiGLU epilogue (MoeConfig::swiglu_backward_in_dgrad, kernels::DgatedArgs) or FP8's SwiGLU
  // backward split over CTAs along I (kernels::Fp8SwigluBackward). The routed set's only: the
  // shared expert has no router weights.
  DeviceBuffer router_grad_partials;

  void allocate(int64_t rows, int64_t inter, int64_t experts, const MoeConfig& config,
                bool router_weights) {
    capacity_rows = rows;
    intermediate = inter;
    num_experts = experts;
    for (DeviceBuffer* buffer : {&hidden, &gate, &up})
      buffer->allocate(rows * inter * 2, "expert buffer");
    if (config.precision == Precision::kBF16)
      for (DeviceBuffer* buffer : {&d_gate, &d_up})
        buffer->allocate(rows * inter * 2, "expert buffer");
    if ((config.swiglu_backward_in_dgrad || config.precision == Precision::kFP8Block) &&
        router_weights)
      router_grad_partials.allocate((inter + 255) / 256 * rows * 4,
                                    "router-weight gradient partials");
  }
  ScheduleView view() const { return ScheduleView::at(schedule.pointer, layout); }
  int64_t bytes() const {
    return schedule.bytes + hidden.bytes + gate.bytes + up.bytes + d_gate.bytes + d_up.bytes +
           router_grad_partials.bytes;
  }
};

struct GpuLayer::State {
  MoeShape shape;
  MoeConfig config;
  int device = 0;
  int sm_count = 0;
  int32_t rank = 0;  // in the expert-parallel group (0 of 1 on its own)
  ExpertSet routed, shared;
  // The macrobatch ring (kernels/common/macrobatch.h): the routed rows, g, u, h, d_out rows, d_g
  // and d_u of one macrobatch of ring_rows schedule rows at a time (routed.capacity_rows =
  // ring_rows); with ring_rows = max_rows (MoeConfig::macrobatch_size >= max_rows) one
  // macrobatch is all.
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
  // MoeConfig::precision = kFP8Block: each expert set's FP8 operands (layer/fp8_buffers.h).
  Fp8SetBuffers fp8_routed, fp8_shared;
  // Counter buffers, zeroed once and never reset (epochs); their layouts are
  // kernels/common/counter_layouts.h: the fused local dispatch's (gather_counters), the
  // persistent forward's (forward_counters) and, with MoeConfig::persistent_backward, the
  // persistent backward's (backward_counters).
  DeviceBuffer gather_state, persistent_state, persistent_backward_state;
  kernels::GatherCounterLayout gather_counters;
  kernels::ForwardCounterLayout forward_counters;
  kernels::BackwardCounterLayout backward_counters;
  // The task traces of the latest persistent forward and backward launch (MoeConfig::trace_tasks;
  // TaskTraceEvent by ticket, room for the most tickets a launch can have; 0xff bytes = empty).
  DeviceBuffer forward_trace, backward_trace;
  int64_t forward_trace_capacity = 0, backward_trace_capacity = 0;
  // MoeConfig::check_finite: the first non-finite input found since the last synchronize
  // (kernels/stages/non_finite_scan.h; kNoNonFinite when none). Allocated only with check_finite.
  DeviceBuffer non_finite_record;
  // MoeConfig::gemm_l2_placement (kernels/gemm/l2_placement.h): the slot of each SM id, the
  // slots' claims followed by the launch epoch (zeroed once), the placement the standalone
  // expert GEMMs get (slot_of_sm null: off, or the probe found no clear partitions), and what
  // the probe found (empty without the knob).
  DeviceBuffer l2_slot_of_sm, l2_claims;
  // MoeConfig::gemm_lockstep_k_blocks (kernels/gemm/lockstep.h): the tick counters, the started
  // count and the launch epoch (zeroed once), and the lockstep the expert GEMMs get (ticks null:
  // off).
  DeviceBuffer lockstep_counters;
  kernels::GemmLockstep lockstep;
  // MoeConfig::gemm_tiles_by_ticket (kernels/gemm/tile_tickets.h): the ticket counter and the
  // launch epoch (zeroed once), and the tickets the expert GEMMs get (counter null: off).
  DeviceBuffer ticket_counters;
  kernels::GemmTickets tickets;
  // The 192-row FP8 tiles' ticket counter and launch epoch (Fp8GemmParams::tile_tickets;
  // zeroed once). The layer's row-tile GEMMs run one after another on its stream.
  DeviceBuffer fp8_ticket_counters;
  kernels::GemmTickets fp8_tile_tickets;
  kernels::L2Placement l2_placement;
  std::string l2_placement_report;
  kernels::WaitDiagnosis* diagnosis = nullptr;  // mapped pinned host memory
  kernels::WaitDiagnosis* diagnosis_device = nullptr;
  uint64_t generation = 0;  // forwards run so far: names the context the workspace holds

  // How tokens arrive and leave (local, or a rank of an expert-parallel group) and how each
  // direction's expert GEMMs run: chosen once, when the layer is built (GpuLayer's constructor).
  std::unique_ptr<TokenExchange> exchange;
  std::unique_ptr<ForwardEngine> forward_engine;
  std::unique_ptr<BackwardEngine> backward_engine;

  State();
  ~State();

  kernels::WaitContext wait_context() const {
    return {static_cast<uint64_t>(config.wait_timeout_s * 1e9), rank, diagnosis_device};
  }
  // Where the layer's kernels launch on `stream`: overlapped with the previous kernel under
  // MoeConfig::overlap_kernel_launches.
  kernels::KernelStream on(cudaStream_t stream) const {
    return {stream, config.overlap_kernel_launches};
  }
  unsigned long long* counter(const DeviceBuffer& buffer, int64_t offset) const {
    return buffer.as<unsigned long long>() + offset;
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

// The workspace of one layer (rank `rank` of shape.num_ranks), every buffer allocated and every
// counter zeroed; its exchange and engines still unset (layer_state.cpp).
std::unique_ptr<GpuLayer::State> make_layer_state(const MoeShape& shape, const MoeConfig& config,
                                                  int32_t rank);

// ---- The expert stages (expert_stages.cpp) -----------------------------------------------------

// Each expert's matrix is row-major; consecutive experts are `*_stride` elements apart (0:
// dense, the matrix's size; larger for views into a fused tensor, e.g. the halves of a
// [E, 2I, H] gate/up weight: TensorView::outer_stride).
struct ExpertWeights {
  const void* gate = nullptr;  // [E, I, H]
  const void* up = nullptr;    // [E, I, H]
  const void* down = nullptr;  // [E, H, I]
  int64_t gate_stride = 0, up_stride = 0, down_stride = 0;
  uint64_t version = 0;  // ForwardArgs::weights_version
  // FP8: the matrices given pre-quantized (ForwardArgs::w_*_fp8; their bf16 pointer is null).
  Fp8View gate_fp8, up_fp8, down_fp8;
};

struct WeightGrads {
  void* d_w_gate = nullptr;  // as ExpertWeights
  void* d_w_up = nullptr;
  void* d_w_down = nullptr;
  int64_t d_w_gate_stride = 0, d_w_up_stride = 0, d_w_down_stride = 0;
  // FP8 only (check_backward_precision): fp32 matrices, and BackwardArgs::accumulate_weight_grads.
  bool d_w_gate_f32 = false, d_w_up_f32 = false, d_w_down_f32 = false;
  bool accumulate = false;
};

// What one expert set's forward reads and writes besides its own buffers: `rows` holds
// `rows_in_map` rows of width H (the routed set: a macrobatch's ring of gathered rows; the
// shared expert: x itself), `out` [out_rows, H] receives y in schedule order (the map clips rows
// past out_rows: the shared expert's output has exactly T rows).
struct ExpertSetForward {
  const ExpertSet* set = nullptr;
  const void* rows = nullptr;
  int64_t rows_in_map = 0;
  ExpertWeights weights;
  void* out = nullptr;
  int64_t out_rows = 0;
  // Expert parallel: the down GEMM also pushes the rows of other ranks' pairs into their slots
  // (TokenExchange::gemm_push; slot_peers null = the push runs after the GEMMs, or none).
  kernels::RowPush push{};
  // ForwardArgs::keep_context: false skips the stores only a backward reads (g and u; FP8's x
  // column groups).
  bool keep_context = true;
};

// The router weights the SwiGLU backward reads and where each pair's gradient goes: this
// rank's d_router_weights, or (expert parallel) the source rank's buffer of pairs_per_rank
// pairs. All null for the shared expert (weight 1, no gradient).
struct RouterWeightRoute {
  const float* weights = nullptr;
  float* grads = nullptr;
  float* const* grad_peers = nullptr;
  int32_t pairs_per_rank = 0;
};

// One expert set's backward: its rows and d_out rows (as ExpertSetForward's rows), its router
// weights, the dx rows [dx_rows, H] out in schedule order, its weight gradients out.
struct ExpertSetBackward {
  const ExpertSet* set = nullptr;
  const void* rows = nullptr;
  const void* d_out_rows = nullptr;
  int64_t rows_in_map = 0;
  ExpertWeights weights;
  RouterWeightRoute router;
  void* dx_out = nullptr;
  int64_t dx_rows = 0;
  WeightGrads grads;
  // Expert parallel: the gate/up dgrad also pushes the dx rows of other ranks' pairs into
  // their slots (TokenExchange::gemm_push; slot_peers null = after the GEMMs, or none).
  kernels::RowPush push{};
};

namespace stages {

// h = swiglu(rows Wg^T, rows Wu^T) (keeping g and u, the forward context), then y = h Wd^T.
// `macrobatch` (the routed experts' State::macrobatch(m); default: all rows) picks the tiles;
// the rows and the set's buffers then hold that macrobatch's rows, `out` stays full size.
void forward_experts(const GpuLayer::State& s, const ExpertSetForward& set,
                     const kernels::FusedGather& gather, cudaStream_t stream,
                     const StageMarker& mark, const kernels::MacrobatchParams& macrobatch = {});
// The same as one persistent kernel (MoeConfig::persistent_forward), one launch per
// macrobatch; with `shared`, the launch also runs the shared expert's tiles after the routed.
void forward_experts_persistent(const GpuLayer::State& s, const ExpertSetForward& routed,
                                const ExpertSetForward* shared, const kernels::FusedGather& gather,
                                const kernels::MacrobatchParams& macrobatch, cudaStream_t stream,
                                const StageMarker& mark);
// Recompute g, u (with `recompute`), dgrad of down with the SwiGLU backward (d_g, d_u, h_w,
// the routed pairs' d_router_weights), the dx rows, the three weight gradients.
// `macrobatch_index` < 0: one pass over all rows; else macrobatch m of the routed experts (the
// weight gradients continue across macrobatches through the partial slots). With `d_out_gather`
// set (its x), the down dgrad GEMM's producer warps gather the d_out rows into set.d_out_rows
// first (the expert-parallel pull, MoeConfig::ep_dispatch_in_gemm); else they are there.
void backward_experts(const GpuLayer::State& s, const ExpertSetBackward& set, bool recompute,
                      cudaStream_t stream, const StageMarker& mark, int32_t macrobatch_index = -1,
                      const kernels::FusedGather& d_out_gather = {});
// The same as one persistent kernel (MoeConfig::persistent_backward; one macrobatch): the rows
// and d_out rows are gathered inside it by the gathers whose `x` is set, else before it; with
// `shared`, the shared expert's backward runs in the same launch. The d_x combine runs after it.
void backward_experts_persistent(const GpuLayer::State& s, const ExpertSetBackward& routed,
                                 const ExpertSetBackward* shared, bool recompute,
                                 const kernels::FusedGather& d_out_gather,
                                 const kernels::FusedGather& x_gather, cudaStream_t stream,
                                 const StageMarker& mark);

// FP8 (MoeConfig::precision = kFP8Block; layer/fp8_stages.cpp): forward_experts and
// backward_experts on e4m3 operands with block scales, one macrobatch, the set's FP8 buffers.
// A gather with a source (`x` non-null: the local exchange's routed rows) is quantized as it is
// gathered, and then no bf16 copy of those rows is made: the forward quantizes x rows both ways
// (the backward's context then holds x's column groups), the backward d_out rows (and x rows
// when it recomputes). Without one, the set's rows are read from `rows` / `d_out_rows`.
void forward_experts_fp8(const GpuLayer::State& s, const ExpertSetForward& set,
                         const kernels::FusedGather& x_gather, const Fp8SetBuffers& fp8,
                         cudaStream_t stream, const StageMarker& mark);
void backward_experts_fp8(const GpuLayer::State& s, const ExpertSetBackward& set, bool recompute,
                          const kernels::FusedGather& d_out_gather,
                          const kernels::FusedGather& x_gather, const Fp8SetBuffers& fp8,
                          cudaStream_t stream, const StageMarker& mark);

}  // namespace stages
}  // namespace mok
