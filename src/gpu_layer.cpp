// GpuLayer: workspace, tensor maps and launches of the single-GPU layer (include/mok/gpu_layer.h).
//
// Workspace (device memory, allocated once per layer object):
//   schedule     ScheduleLayout of the routing (rank 0 of 1)
//   rows         [max_rows, H] bf16: routed x rows in schedule order (padding rows zero)
//   hidden       [max_rows, I] bf16: h = swiglu(gate, up) per row
//   expert_out   [max_rows, H] bf16: the down GEMM's output rows (backward: the dx rows) in
//                schedule order; the combine reads pair p's row pair_row[p]
//   shared_*     the shared expert's own "schedule" (one expert, T rows, identity row map),
//                its hidden [ceil128(T), Is] and output [T, H]
// Diagnosis: a WaitDiagnosis in mapped pinned host memory (kernels/wait.cuh).
#include "mok/gpu_layer.h"

#include <cuda.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "cuda_buffer.h"
#include "kernels/launchers.h"
#include "mok/schedule.h"
#include "mok/schedule_gpu.h"
#include "tma.h"
#include "wait_report.h"

namespace mok {

namespace {

int64_t round_up(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace

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
  DeviceBuffer rows;        // [max_rows, H]: routed x rows in schedule order (padding rows zero)
  DeviceBuffer d_out_rows;  // [max_rows, H]: routed d_out rows (backward)
  DeviceBuffer expert_out;  // [max_rows, H]: expert output rows / backward dx rows, schedule order
  DeviceBuffer shared_out;  // [T, H]: the shared expert's output (forward) or dx (backward)
  // The fused local dispatch's counters (dispatch_local.cuh): [0] ticket, [1] epoch,
  // [2 .. 2 + max_tiles) per-tile row counts; zeroed once, never reset (epochs).
  DeviceBuffer gather_state;
  // The persistent forward's counters (forward_gemms.cu): [0] ticket, [1] epoch,
  // [2 .. 2 + max_tiles) gate/up tiles done per row tile; zeroed once, never reset (epochs).
  DeviceBuffer persistent_state;
  kernels::WaitDiagnosis* diagnosis = nullptr;  // mapped pinned host memory
  kernels::WaitDiagnosis* diagnosis_device = nullptr;
  uint64_t generation = 0;  // forwards run so far: names the context the workspace holds

  ~State() {
    if (diagnosis != nullptr) cudaFreeHost(diagnosis);
  }

  kernels::WaitContext wait_context() const {
    return {static_cast<uint64_t>(config.wait_timeout_s * 1e9), 0, diagnosis_device};
  }
};

GpuLayer::GpuLayer(const MoeShape& shape, const MoeConfig& config)
    : state_(std::make_unique<State>()) {
  can_implement(config, shape).throw_if_error();
  if (shape.num_ranks != 1)
    throw Error(ErrorCode::kUnsupported,
                "GpuLayer: num_ranks = " + std::to_string(shape.num_ranks) +
                    " is not supported yet; valid: 1 (multi-GPU comes with the "
                    "communication layer)");
  State& s = *state_;
  s.shape = shape;
  s.config = config;
  cuda_check(cudaGetDevice(&s.device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&s.sm_count, cudaDevAttrMultiProcessorCount, s.device),
             "SM count");
  int major = 0;
  cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, s.device),
             "compute capability");
  if (major != 9)
    throw Error(ErrorCode::kUnsupported, "GpuLayer: device " + std::to_string(s.device) +
                                             " has compute capability " + std::to_string(major) +
                                             ".x; mok's kernels need Hopper (9.0, sm_90a)");

  const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate;
  ScheduleParams params;
  params.num_ranks = 1;
  params.tokens_per_rank = static_cast<int32_t>(T);
  params.top_k = shape.top_k;
  params.num_experts = static_cast<int32_t>(shape.num_experts);
  s.routed.layout = ScheduleLayout::make(params);
  const int64_t max_rows = params.max_rows();
  s.routed.schedule.allocate(s.routed.layout.total_bytes, "schedule buffer");
  s.routed.allocate(max_rows, I, shape.num_local_experts());
  s.rows.allocate(max_rows * H * 2, "routed rows buffer");
  s.d_out_rows.allocate(max_rows * H * 2, "routed d_out rows buffer");
  s.expert_out.allocate(max_rows * H * 2, "expert output rows buffer");
  s.gather_state.allocate((2 + params.max_tiles()) * 8, "gather counters");
  cuda_check(cudaMemset(s.gather_state.pointer, 0, s.gather_state.bytes), "zero gather counters");
  s.persistent_state.allocate((2 + params.max_tiles()) * 8, "persistent forward counters");
  cuda_check(cudaMemset(s.persistent_state.pointer, 0, s.persistent_state.bytes),
             "zero persistent forward counters");

  if (shape.has_shared_expert()) {
    // The shared expert runs through the same kernels as one expert that every token visits:
    // a fixed schedule with an identity row map, built once here.
    ScheduleParams shared_params;
    shared_params.num_ranks = 1;
    shared_params.tokens_per_rank = static_cast<int32_t>(T);
    shared_params.top_k = 1;
    shared_params.num_experts = 1;
    s.shared.layout = ScheduleLayout::make(shared_params);
    std::vector<int32_t> identity(static_cast<size_t>(T), 0);
    std::vector<char> host(s.shared.layout.output_bytes);
    build_schedule_host(s.shared.layout, identity.data(), DType::kInt32, host.data());
    s.shared.schedule.allocate(s.shared.layout.total_bytes, "shared expert schedule");
    cuda_check(
        cudaMemcpy(s.shared.schedule.pointer, host.data(), host.size(), cudaMemcpyHostToDevice),
        "upload shared expert schedule");
    s.shared.allocate(round_up(std::max<int64_t>(T, 1), 128), shape.shared_intermediate, 1);
    s.shared_out.allocate(T * H * 2, "shared output buffer");
  }

  cuda_check(cudaHostAlloc(reinterpret_cast<void**>(&s.diagnosis), sizeof(kernels::WaitDiagnosis),
                           cudaHostAllocMapped),
             "diagnosis record");
  *s.diagnosis = kernels::WaitDiagnosis{};
  cuda_check(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&s.diagnosis_device), s.diagnosis, 0),
      "diagnosis record device pointer");
}

GpuLayer::~GpuLayer() = default;

const MoeShape& GpuLayer::shape() const { return state_->shape; }

int64_t GpuLayer::workspace_bytes() const {
  const State& s = *state_;
  return s.routed.bytes() + s.shared.bytes() + s.rows.bytes + s.d_out_rows.bytes +
         s.expert_out.bytes + s.shared_out.bytes + s.gather_state.bytes + s.persistent_state.bytes;
}

namespace {

using StageMarker = std::function<void(const char*)>;

// Tensor maps: K-major operands are read in [128 rows x 64] boxes (A) or [128|256 x 64] (B);
// MN-major ones in [64 K-rows x 64] boxes.
CUtensorMap k_major_rows(const void* base, int64_t width, int64_t rows, const char* what) {
  return make_tensor_map_2d(base, width, rows, 64, 128, what);
}
CUtensorMap mn_major_rows(const void* base, int64_t width, int64_t rows, const char* what) {
  return make_tensor_map_2d(base, width, rows, 64, 64, what);
}
CUtensorMap k_major_weights(const void* base, int64_t k, int64_t n, int64_t experts, int32_t box_n,
                            const char* what) {
  return make_tensor_map_3d(base, k, n, experts, 64, box_n, what);
}
// The staging-tile epilogue's store map of [rows, width] outputs: [128 rows x 64] boxes (3-D
// with one batch, like the weight gradients' maps).
CUtensorMap output_rows(void* base, int64_t width, int64_t rows, const char* what) {
  return make_tensor_map_3d(base, width, rows, 1, 64, 128, what);
}
CUtensorMap mn_major_weights(const void* base, int64_t n, int64_t k, int64_t experts,
                             const char* what) {
  return make_tensor_map_3d(base, n, k, experts, 64, 64, what);
}

kernels::ExpertGemmParams base_params(const GpuLayer::State& s, const ExpertSet& set) {
  kernels::ExpertGemmParams params{};
  const ScheduleView view = set.view();
  params.header = view.header;
  params.tile_expert = view.tile_expert;
  params.row_pair = view.row_pair;
  params.expert_offsets = view.expert_offsets;
  params.num_experts = static_cast<int32_t>(set.num_experts);
  params.swiglu_limit = s.shape.swiglu_limit;
  params.wait = s.wait_context();
  return params;
}

void launch(const GpuLayer::State& s, kernels::ExpertGemmForm form,
            const kernels::ExpertGemmMaps& maps, const kernels::ExpertGemmParams& params,
            cudaStream_t stream, const char* what) {
  cuda_check(kernels::launch_expert_gemm(form, maps, params, s.sm_count, stream), what);
}

// Forward of one expert set: h = swiglu(rows Wg^T, rows Wu^T) (keeping g and u, the forward
// context), then y = h Wd^T. `rows` holds `rows_in_map` rows of width H; `out` [out_rows, H]
// receives y in schedule order (the map clips rows past out_rows: the shared expert's output
// has exactly T rows).
void forward_experts(const GpuLayer::State& s, const ExpertSet& set, const void* rows,
                     int64_t rows_in_map, const void* w_gate, const void* w_up, const void* w_down,
                     void* out, int64_t out_rows, const kernels::FusedGather& gather,
                     cudaStream_t stream, const StageMarker& mark) {
  const int64_t H = s.shape.hidden, I = set.intermediate, E = set.num_experts;
  const int64_t R = set.capacity_rows;
  kernels::ExpertGemmMaps maps{};
  maps.a0 = maps.a1 = k_major_rows(rows, H, rows_in_map, "expert rows");
  maps.b0 = k_major_weights(w_gate, H, I, E, 128, "w_gate");
  maps.b1 = k_major_weights(w_up, H, I, E, 128, "w_up");
  maps.out = output_rows(set.hidden.pointer, I, R, "hidden");
  maps.out2 = output_rows(set.gate.pointer, I, R, "gate (forward context)");
  maps.out3 = output_rows(set.up.pointer, I, R, "up (forward context)");
  kernels::ExpertGemmParams params = base_params(s, set);
  params.n_extent = static_cast<int32_t>(I);
  params.k_extent = static_cast<int32_t>(H);
  params.gather = gather;
  launch(s, kernels::ExpertGemmForm::kGateUpSwiGLU, maps, params, stream, "gate/up GEMM");
  if (gather.x != nullptr) {
    cuda_check(kernels::launch_advance_epoch(gather.epoch, stream), "advance the gather epoch");
    mark("gather + gate/up GEMM + SwiGLU");
  } else {
    mark("gate/up GEMM + SwiGLU");
  }

  maps.a0 = maps.a1 = k_major_rows(set.hidden.pointer, I, R, "hidden");
  maps.b0 = maps.b1 = k_major_weights(w_down, I, H, E, 256, "w_down");
  maps.out = output_rows(out, H, out_rows, "expert output rows");
  params.n_extent = static_cast<int32_t>(H);
  params.k_extent = static_cast<int32_t>(I);
  params.gather = kernels::FusedGather{};
  launch(s, kernels::ExpertGemmForm::kDownStore, maps, params, stream, "down GEMM");
  mark("down GEMM");
}

// The routed experts' forward as one persistent kernel (forward_gemms.cu): the same GEMMs and
// epilogues as forward_experts, with the fused local dispatch when `gather.x` is set.
void forward_experts_persistent(const GpuLayer::State& s, const ExpertSet& set, const void* rows,
                                int64_t rows_in_map, const void* w_gate, const void* w_up,
                                const void* w_down, void* out, int64_t out_rows,
                                const kernels::FusedGather& gather, cudaStream_t stream,
                                const StageMarker& mark) {
  const int64_t H = s.shape.hidden, I = set.intermediate, E = set.num_experts;
  const int64_t R = set.capacity_rows;
  kernels::ForwardGemmsMaps maps{};
  maps.x_rows = k_major_rows(rows, H, rows_in_map, "expert rows");
  maps.w_gate = k_major_weights(w_gate, H, I, E, 128, "w_gate");
  maps.w_up = k_major_weights(w_up, H, I, E, 128, "w_up");
  maps.hidden_in = k_major_rows(set.hidden.pointer, I, R, "hidden");
  maps.w_down = k_major_weights(w_down, I, H, E, 256, "w_down");
  maps.hidden_out = output_rows(set.hidden.pointer, I, R, "hidden");
  maps.gate_out = output_rows(set.gate.pointer, I, R, "gate (forward context)");
  maps.up_out = output_rows(set.up.pointer, I, R, "up (forward context)");
  maps.y_out = output_rows(out, H, out_rows, "expert output rows");
  kernels::ForwardGemmsParams params{};
  params.gate_up = base_params(s, set);
  params.gate_up.n_extent = static_cast<int32_t>(I);
  params.gate_up.k_extent = static_cast<int32_t>(H);
  params.gate_up.gather = gather;
  params.down = base_params(s, set);
  params.down.n_extent = static_cast<int32_t>(H);
  params.down.k_extent = static_cast<int32_t>(I);
  params.minibatch_tiles = static_cast<int32_t>(s.config.minibatch_size / kDefaultRowAlign);
  unsigned long long* counters = s.persistent_state.as<unsigned long long>();
  params.ticket = counters;
  params.epoch = counters + 1;
  params.gate_up_done = counters + 2;
  cuda_check(kernels::launch_forward_gemms(maps, params, s.sm_count, stream),
             "persistent forward GEMM kernel");
  cuda_check(kernels::launch_advance_epoch(params.epoch, stream),
             "advance the persistent forward's epoch");
  if (gather.x != nullptr)
    cuda_check(kernels::launch_advance_epoch(gather.epoch, stream), "advance the gather epoch");
  mark(gather.x != nullptr ? "gather + gate/up + down (persistent)"
                           : "gate/up + down (persistent)");
}

struct WeightGrads {
  void* d_w_gate;
  void* d_w_up;
  void* d_w_down;
};

// Backward of one expert set: recompute g, u (unless the forward context holds them); dgrad of down
// with SwiGLU backward (d_g, d_u, h_w, d_router_weights of routed pairs); dx rows in schedule
// order into dx_out [dx_rows, H]; the three weight gradients. router_weights null = weight 1
// (the shared expert).
void backward_experts(const GpuLayer::State& s, const ExpertSet& set, const void* rows,
                      const void* d_out_rows, int64_t rows_in_map, const void* w_gate,
                      const void* w_up, const void* w_down, const float* router_weights,
                      float* d_router_weights, void* dx_out, int64_t dx_rows,
                      const WeightGrads& grads, bool recompute, cudaStream_t stream,
                      const StageMarker& mark) {
  const int64_t H = s.shape.hidden, I = set.intermediate, E = set.num_experts,
                R = set.capacity_rows;
  kernels::ExpertGemmParams params = base_params(s, set);

  kernels::ExpertGemmMaps maps{};
  maps.a0 = maps.a1 = k_major_rows(rows, H, rows_in_map, "expert rows");
  maps.b0 = k_major_weights(w_gate, H, I, E, 128, "w_gate");
  maps.b1 = k_major_weights(w_up, H, I, E, 128, "w_up");
  maps.out = output_rows(set.gate.pointer, I, R, "gate (recomputed)");
  maps.out2 = output_rows(set.up.pointer, I, R, "up (recomputed)");
  params.n_extent = static_cast<int32_t>(I);
  params.k_extent = static_cast<int32_t>(H);
  if (recompute) {
    launch(s, kernels::ExpertGemmForm::kGateUpStore, maps, params, stream,
           "gate/up recompute GEMM");
    mark("gate/up recompute");
  }

  // dh_raw = bf16(d_out Wd) into `hidden`; the SwiGLU backward then turns it into h_w in place.
  maps.a0 = maps.a1 = k_major_rows(d_out_rows, H, rows_in_map, "d_out rows");
  maps.b0 = maps.b1 = mn_major_weights(w_down, I, H, E, "w_down (MN-major)");
  maps.out = output_rows(set.hidden.pointer, I, R, "dh_raw");
  launch(s, kernels::ExpertGemmForm::kDownGrad, maps, params, stream, "down dgrad GEMM");
  mark("down dgrad");
  const ScheduleView view = set.view();
  cuda_check(kernels::launch_swiglu_backward(
                 view.header, 0, set.gate.pointer, set.up.pointer, set.hidden.pointer,
                 view.row_pair, router_weights, I, s.shape.swiglu_limit, set.d_gate.pointer,
                 set.d_up.pointer, set.hidden.pointer, d_router_weights, stream),
             "SwiGLU backward launch");
  mark("SwiGLU backward + router weight gradient");

  maps.a0 = k_major_rows(set.d_gate.pointer, I, R, "d_gate");
  maps.a1 = k_major_rows(set.d_up.pointer, I, R, "d_up");
  maps.b0 = mn_major_weights(w_gate, H, I, E, "w_gate (MN-major)");
  maps.b1 = mn_major_weights(w_up, H, I, E, "w_up (MN-major)");
  params.n_extent = static_cast<int32_t>(H);
  params.k_extent = static_cast<int32_t>(I);
  maps.out = output_rows(dx_out, H, dx_rows, "dx rows");
  launch(s, kernels::ExpertGemmForm::kGateUpGradStore, maps, params, stream, "gate/up dgrad GEMM");
  mark("gate/up dgrad");

  // Weight gradients: K = the expert's rows (zero on padding rows), both operands MN-major.
  const CUtensorMap x_rows = mn_major_rows(rows, H, rows_in_map, "expert rows (MN-major)");
  // `a_rows`: rows the A operand's memory holds (d_out of the shared expert has only T rows;
  // TMA fills the rest of the last tile with zeros).
  auto weight_grad = [&](const void* a, int64_t a_rows, int64_t m, const CUtensorMap& b, int64_t n,
                         void* out, const char* what) {
    kernels::ExpertGemmMaps wgrad_maps{};
    wgrad_maps.a0 = wgrad_maps.a1 = mn_major_rows(a, m, a_rows, what);
    wgrad_maps.b0 = wgrad_maps.b1 = b;
    wgrad_maps.out = make_tensor_map_3d(out, n, m, E, 64, 128, what);
    kernels::ExpertGemmParams wgrad = base_params(s, set);
    wgrad.m_extent = static_cast<int32_t>(m);
    wgrad.n_extent = static_cast<int32_t>(n);
    launch(s, kernels::ExpertGemmForm::kWeightGrad, wgrad_maps, wgrad, stream, what);
  };
  weight_grad(set.d_gate.pointer, R, I, x_rows, H, grads.d_w_gate, "weight gradient of gate");
  weight_grad(set.d_up.pointer, R, I, x_rows, H, grads.d_w_up, "weight gradient of up");
  weight_grad(d_out_rows, rows_in_map, H, mn_major_rows(set.hidden.pointer, I, R, "h_w (MN-major)"),
              I, grads.d_w_down, "weight gradient of down");
  mark("weight gradients");
}

}  // namespace

// The forward as a sequence of stages; `mark(name)` is called after each one (profiling).
static void run_forward(GpuLayer::State& s, const ForwardArgs& args, cudaStream_t stream,
                        const StageMarker& mark) {
  const MoeShape& shape = s.shape;
  const int64_t T = shape.num_tokens, H = shape.hidden;
  launch_build_schedule(s.routed.layout, args.top_experts.data, args.top_experts.dtype,
                        s.routed.schedule.pointer, stream)
      .throw_if_error();
  mark("schedule");
  // The local dispatch (config.local_dispatch): its own kernel, or inside the gate/up GEMM
  // (the producer warpgroup's spare warps, or the producer warp's one-row TMA loads).
  const int64_t max_rows = s.routed.capacity_rows;
  const LocalDispatch dispatch = T > 0 ? s.config.local_dispatch : LocalDispatch::kGatherKernel;
  kernels::FusedGather gather{};
  if (dispatch == LocalDispatch::kGatherKernel) {
    const ScheduleView view = s.routed.view();
    cuda_check(kernels::launch_gather_rows(view.header, view.row_pair, args.x.data, H, shape.top_k,
                                           s.rows.pointer, max_rows, stream),
               "gather launch");
    mark("gather");
  }
  unsigned long long* counters = s.gather_state.as<unsigned long long>();
  gather.x =
      dispatch == LocalDispatch::kProducerWarps ? args.x.data_as<const __nv_bfloat16>() : nullptr;
  gather.rows = s.rows.as<__nv_bfloat16>();
  gather.hidden = static_cast<int32_t>(H);
  gather.top_k = shape.top_k;
  gather.ticket = counters;
  gather.epoch = counters + 1;
  gather.tile_rows_done = counters + 2;
  if (s.config.persistent_forward)
    forward_experts_persistent(s, s.routed, s.rows.pointer, max_rows, args.w_gate.data,
                               args.w_up.data, args.w_down.data, s.expert_out.pointer, max_rows,
                               gather, stream, mark);
  else
    forward_experts(s, s.routed, s.rows.pointer, max_rows, args.w_gate.data, args.w_up.data,
                    args.w_down.data, s.expert_out.pointer, max_rows, gather, stream, mark);
  if (shape.has_shared_expert() && T > 0) {
    forward_experts(s, s.shared, args.x.data, T, args.w_shared_gate.data, args.w_shared_up.data,
                    args.w_shared_down.data, s.shared_out.pointer, T, kernels::FusedGather{},
                    stream, [](const char*) {});
    mark("shared expert");
  }
  cuda_check(kernels::launch_combine(s.expert_out.pointer, s.routed.view().pair_row,
                                     shape.has_shared_expert() ? s.shared_out.pointer : nullptr,
                                     args.router_weights.data_as<const float>(), T, H, shape.top_k,
                                     args.out.data, stream),
             "combine launch");
  mark("combine");
}

// With `use_context`, the forward that ran last on this layer left the schedule, the gathered x
// rows and g, u of every row (routed and shared) in the workspace: the backward starts from
// them instead of rebuilding and recomputing.
static void run_backward(GpuLayer::State& s, const BackwardArgs& args, bool use_context,
                         cudaStream_t stream, const StageMarker& mark) {
  const MoeShape& shape = s.shape;
  const ForwardArgs& fwd = args.forward;
  const int64_t T = shape.num_tokens, H = shape.hidden;
  if (!use_context) {
    launch_build_schedule(s.routed.layout, fwd.top_experts.data, fwd.top_experts.dtype,
                          s.routed.schedule.pointer, stream)
        .throw_if_error();
    mark("schedule");
  }
  const ScheduleView view = s.routed.view();
  const int64_t max_rows = s.routed.capacity_rows;
  if (!use_context)
    cuda_check(kernels::launch_gather_rows(view.header, view.row_pair, fwd.x.data, H, shape.top_k,
                                           s.rows.pointer, max_rows, stream),
               "gather launch");
  cuda_check(kernels::launch_gather_rows(view.header, view.row_pair, args.d_out.data, H,
                                         shape.top_k, s.d_out_rows.pointer, max_rows, stream),
             "gather d_out launch");
  // Pairs not routed here (expert -1) keep 0; the SwiGLU backward writes the routed ones.
  cuda_check(cudaMemsetAsync(args.d_router_weights.data, 0, args.d_router_weights.nbytes(), stream),
             "zero d_router_weights");
  mark(use_context ? "gather d_out" : "gather x, d_out");
  backward_experts(s, s.routed, s.rows.pointer, s.d_out_rows.pointer, max_rows, fwd.w_gate.data,
                   fwd.w_up.data, fwd.w_down.data, fwd.router_weights.data_as<const float>(),
                   args.d_router_weights.data_as<float>(), s.expert_out.pointer, max_rows,
                   {args.d_w_gate.data, args.d_w_up.data, args.d_w_down.data}, !use_context, stream,
                   mark);
  if (shape.has_shared_expert()) {
    if (T > 0) {
      backward_experts(
          s, s.shared, fwd.x.data, args.d_out.data, T, fwd.w_shared_gate.data, fwd.w_shared_up.data,
          fwd.w_shared_down.data, nullptr, nullptr, s.shared_out.pointer, T,
          {args.d_w_shared_gate.data, args.d_w_shared_up.data, args.d_w_shared_down.data},
          !use_context, stream, [](const char*) {});
    } else {
      for (const TensorView* grad :
           {&args.d_w_shared_gate, &args.d_w_shared_up, &args.d_w_shared_down})
        cuda_check(cudaMemsetAsync(grad->data, 0, grad->nbytes(), stream),
                   "zero shared weight gradients");
    }
    mark("shared expert");
  }
  cuda_check(kernels::launch_combine(s.expert_out.pointer, view.pair_row,
                                     shape.has_shared_expert() ? s.shared_out.pointer : nullptr,
                                     nullptr, T, H, shape.top_k, args.d_x.data, stream),
             "d_x combine launch");
  mark("d_x combine");
}

ForwardContext GpuLayer::forward(const ForwardArgs& args, cudaStream_t stream) {
  State& s = *state_;
  check_forward_args(s.shape, args, DeviceType::kCUDA).throw_if_error();
  if (args.x.device_id != s.device)
    throw Error(ErrorCode::kInvalidArgument,
                "forward: tensors are on cuda:" + std::to_string(args.x.device_id) +
                    " but the layer's workspace is on cuda:" + std::to_string(s.device));
  run_forward(s, args, stream, [](const char*) {});
  return ForwardContext{++s.generation};
}

namespace {

// True when `context` names the layer's current forward; throws for a stale one.
bool context_is_current(const GpuLayer::State& s, const ForwardContext* context) {
  if (context == nullptr) return false;
  if (context->generation == 0 || context->generation != s.generation)
    throw Error(ErrorCode::kInvalidArgument,
                "backward: context #" + std::to_string(context->generation) +
                    " is stale: the layer's workspace holds context #" +
                    std::to_string(s.generation) +
                    " (each forward, and each backward without a context, replaces it); pass the "
                    "context of the latest forward on this layer, or none to recompute");
  return true;
}

}  // namespace

void GpuLayer::backward(const BackwardArgs& args, cudaStream_t stream,
                        const ForwardContext* context) {
  State& s = *state_;
  check_backward_args(s.shape, args, DeviceType::kCUDA).throw_if_error();
  if (args.d_out.device_id != s.device)
    throw Error(ErrorCode::kInvalidArgument,
                "backward: tensors are on cuda:" + std::to_string(args.d_out.device_id) +
                    " but the layer's workspace is on cuda:" + std::to_string(s.device));
  const bool use_context = context_is_current(s, context);
  if (!use_context) ++s.generation;  // the recompute overwrites the latest forward's context
  run_backward(s, args, use_context, stream, [](const char*) {});
}

namespace {

// Runs `run(mark)` `iterations` times with events at every mark; the median of each stage.
std::vector<std::pair<std::string, float>> profile_stages(
    cudaStream_t stream, int iterations, const std::function<void(const StageMarker&)>& run) {
  std::vector<std::string> names;
  std::vector<std::vector<float>> samples;
  std::vector<cudaEvent_t> events;
  auto event_at = [&](size_t index) {
    while (events.size() <= index) {
      cudaEvent_t event;
      cuda_check(cudaEventCreate(&event), "cudaEventCreate");
      events.push_back(event);
    }
    return events[index];
  };
  for (int iteration = 0; iteration < iterations; ++iteration) {
    size_t marker = 0;
    cuda_check(cudaEventRecord(event_at(marker++), stream), "cudaEventRecord");
    std::vector<std::string> stage_names;
    run([&](const char* name) {
      cuda_check(cudaEventRecord(event_at(marker++), stream), "cudaEventRecord");
      stage_names.push_back(name);
    });
    cuda_check(cudaStreamSynchronize(stream), "profile synchronize");
    if (iteration == 0) {
      names = stage_names;
      names.push_back("total");
      samples.assign(names.size(), {});
    }
    for (size_t stage = 0; stage + 1 < marker; ++stage) {
      float ms = 0;
      cuda_check(cudaEventElapsedTime(&ms, events[stage], events[stage + 1]),
                 "cudaEventElapsedTime");
      samples[stage].push_back(ms);
    }
    float total = 0;
    cuda_check(cudaEventElapsedTime(&total, events[0], events[marker - 1]), "cudaEventElapsedTime");
    samples.back().push_back(total);
  }
  for (cudaEvent_t event : events) cudaEventDestroy(event);
  std::vector<std::pair<std::string, float>> medians;
  for (size_t stage = 0; stage < names.size(); ++stage) {
    std::vector<float>& values = samples[stage];
    std::sort(values.begin(), values.end());
    medians.emplace_back(names[stage], values.empty() ? 0.0f : values[values.size() / 2]);
  }
  return medians;
}

}  // namespace

std::vector<std::pair<std::string, float>> GpuLayer::profile_forward(const ForwardArgs& args,
                                                                     cudaStream_t stream,
                                                                     int iterations) {
  State& s = *state_;
  check_forward_args(s.shape, args, DeviceType::kCUDA).throw_if_error();
  return profile_stages(stream, iterations,
                        [&](const StageMarker& mark) { run_forward(s, args, stream, mark); });
}

std::vector<std::pair<std::string, float>> GpuLayer::profile_backward(
    const BackwardArgs& args, cudaStream_t stream, int iterations, const ForwardContext* context) {
  State& s = *state_;
  check_backward_args(s.shape, args, DeviceType::kCUDA).throw_if_error();
  const bool use_context = context_is_current(s, context);
  if (!use_context) ++s.generation;
  return profile_stages(stream, iterations, [&](const StageMarker& mark) {
    run_backward(s, args, use_context, stream, mark);
  });
}

Status GpuLayer::synchronize(cudaStream_t stream) {
  State& s = *state_;
  cudaError_t status = cudaStreamSynchronize(stream);
  if (s.diagnosis->timed_out != 0)
    return Status{ErrorCode::kTimeout, describe_wait_diagnosis(*s.diagnosis)};
  if (status != cudaSuccess)
    return Status{ErrorCode::kCudaError, std::string("layer: ") + cudaGetErrorString(status)};
  ScheduleHeader header{};
  const ScheduleView view = s.routed.view();
  status = cudaMemcpy(&header, view.header, sizeof(header), cudaMemcpyDeviceToHost);
  if (status != cudaSuccess)
    return Status{ErrorCode::kCudaError,
                  std::string("reading the schedule header: ") + cudaGetErrorString(status)};
  Status routing = schedule_status(s.routed.layout.params, header);
  if (!routing.ok()) return Status{ErrorCode::kDeviceFault, routing.message};
  return Status::Ok();
}

}  // namespace mok
