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

#include "kernels/gemm/launch.h"
#include "kernels/persistent/launch.h"
#include "kernels/stages/launch.h"
#include "layer/cuda_buffer.h"
#include "layer/gpu_layer_state.h"
#include "layer/non_finite_report.h"
#include "layer/tma.h"
#include "layer/wait_report.h"
#include "mok/schedule.h"
#include "mok/schedule_gpu.h"

namespace mok {

GpuLayer::GpuLayer(const MoeShape& shape, const MoeConfig& config)
    : GpuLayer(shape, config, 0, nullptr) {}

GpuLayer::GpuLayer(const MoeShape& shape, const MoeConfig& config, int32_t rank, EpRank* ep)
    : state_(std::make_unique<State>()) {
  can_implement(config, shape).throw_if_error();
  if (shape.num_ranks != 1 && ep == nullptr)
    throw Error(ErrorCode::kInvalidArgument,
                "GpuLayer: num_ranks = " + std::to_string(shape.num_ranks) +
                    "; a GpuLayer runs one GPU on its own (valid: 1); an expert-parallel group "
                    "of several GPUs is an EpLayer (include/mok/ep_layer.h)");
  State& s = *state_;
  s.shape = shape;
  s.config = config;
  s.rank = rank;
  s.ep = ep;
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
  const ScheduleParams params = schedule_params(shape, rank);
  s.routed.layout = ScheduleLayout::make(params);
  const int64_t max_rows = params.max_rows();
  // The macrobatch ring: one macrobatch when macrobatch_size covers the worst case.
  s.ring_rows = std::min<int64_t>(config.macrobatch_size, max_rows);
  s.num_macrobatches = static_cast<int32_t>((max_rows + s.ring_rows - 1) / s.ring_rows);
  s.routed.schedule.allocate(s.routed.layout.total_bytes, "schedule buffer");
  s.routed.allocate(s.ring_rows, I, shape.num_local_experts());
  s.rows.allocate(s.ring_rows * H * 2, "routed rows buffer (one macrobatch)");
  s.d_out_rows.allocate(s.ring_rows * H * 2, "routed d_out rows buffer (one macrobatch)");
  s.expert_out.allocate(max_rows * H * 2, "expert output rows buffer");
  if (s.num_macrobatches > 1) {
    // One [M x N] fp32 weight gradient per slot, in 128 x 256 tiles (expert_gemm.cu).
    s.partial_floats =
        std::max(round_up(I, 128) * round_up(H, 256), round_up(H, 128) * round_up(I, 256));
    s.wgrad_partials.allocate(3 * 2 * s.partial_floats * 4, "weight-gradient partial sums");
  }
  s.gather_state.allocate((2 + params.max_tiles()) * 8, "gather counters");
  cuda_check(cudaMemset(s.gather_state.pointer, 0, s.gather_state.bytes), "zero gather counters");
  // The shared expert's row tiles (its counters follow the routed ones'; its tiles run in the
  // persistent forward's last launch).
  const int64_t shared_tiles = shape.has_shared_expert() ? (T + 127) / 128 : 0;
  s.persistent_state.allocate((2 + params.max_tiles() + shared_tiles) * 8,
                              "persistent forward counters");
  cuda_check(cudaMemset(s.persistent_state.pointer, 0, s.persistent_state.bytes),
             "zero persistent forward counters");
  if (config.persistent_backward) {
    // Ticket, epoch, the routed set's counters, the fused gathers', the shared expert's.
    s.persistent_backward_state.allocate((2 + 2 * params.max_tiles() + shape.num_local_experts() +
                                          2 * (2 + params.max_tiles()) + 2 * shared_tiles + 1) *
                                             8,
                                         "persistent backward counters");
    cuda_check(
        cudaMemset(s.persistent_backward_state.pointer, 0, s.persistent_backward_state.bytes),
        "zero persistent backward counters");
  }

  if (config.trace_tasks) {
    // The most tickets a launch can have: every tile of the worst-case schedule.
    const int64_t max_tiles = params.max_tiles(), E_loc = shape.num_local_experts();
    const int64_t gate_up_n = (I + 127) / 128, down_n = (H + 255) / 256, inter_n = (I + 255) / 256;
    s.forward_trace_capacity = max_tiles * (gate_up_n + down_n) +
                               shared_tiles * ((shape.shared_intermediate + 127) / 128 + down_n);
    s.backward_trace_capacity = max_tiles * (2 + gate_up_n + inter_n + down_n) +
                                E_loc * (2 * gate_up_n * down_n + ((H + 127) / 128) * inter_n) +
                                shared_tiles * (2 + (shape.shared_intermediate + 127) / 128 +
                                                (shape.shared_intermediate + 255) / 256 + down_n) +
                                2 * ((shape.shared_intermediate + 127) / 128) * down_n +
                                ((H + 127) / 128) * ((shape.shared_intermediate + 255) / 256);
    s.forward_trace.allocate(s.forward_trace_capacity * sizeof(TaskTraceEvent),
                             "persistent forward task trace");
    s.backward_trace.allocate(s.backward_trace_capacity * sizeof(TaskTraceEvent),
                              "persistent backward task trace");
    for (DeviceBuffer* trace : {&s.forward_trace, &s.backward_trace})
      cuda_check(cudaMemset(trace->pointer, 0xff, trace->bytes), "empty a task trace");
  }

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
  if (config.check_finite) {
    s.non_finite_record.allocate(sizeof(unsigned long long), "non-finite input record");
    cuda_check(cudaMemset(s.non_finite_record.pointer, 0xff, s.non_finite_record.bytes),
               "clear the non-finite input record");
  }
}

GpuLayer::~GpuLayer() = default;

const MoeShape& GpuLayer::shape() const { return state_->shape; }

int64_t GpuLayer::workspace_bytes() const {
  const State& s = *state_;
  return s.routed.bytes() + s.shared.bytes() + s.rows.bytes + s.d_out_rows.bytes +
         s.expert_out.bytes + s.shared_out.bytes + s.gather_state.bytes + s.persistent_state.bytes +
         s.persistent_backward_state.bytes + s.wgrad_partials.bytes + s.forward_trace.bytes +
         s.backward_trace.bytes;
}

std::vector<TaskTrace> GpuLayer::task_traces(cudaStream_t stream) {
  const State& s = *state_;
  cuda_check(cudaStreamSynchronize(stream), "task_traces: synchronize");
  std::vector<TaskTrace> traces;
  // A kernel that never ran left its buffer empty (kind -1 everywhere).
  auto download = [&](const DeviceBuffer& buffer, int64_t capacity, const char* kernel,
                      std::vector<std::string> kind_names) {
    TaskTrace trace;
    trace.kernel = kernel;
    trace.kind_names = std::move(kind_names);
    trace.events.resize(static_cast<size_t>(capacity));
    cuda_check(
        cudaMemcpy(trace.events.data(), buffer.pointer, buffer.bytes, cudaMemcpyDeviceToHost),
        "task_traces: download");
    if (std::any_of(trace.events.begin(), trace.events.end(),
                    [](const TaskTraceEvent& event) { return event.kind >= 0; }))
      traces.push_back(std::move(trace));
  };
  if (s.forward_trace_capacity > 0)
    download(s.forward_trace, s.forward_trace_capacity, "persistent forward",
             {"gather", "gate/up", "down", "combine", "shared gate/up",
              "shared down"});  // kernels::TaskKind
  if (s.backward_trace_capacity > 0)
    download(s.backward_trace, s.backward_trace_capacity, "persistent backward",
             {"rows", "recompute", "down dgrad", "SwiGLU", "gate/up dgrad", "weight gradient",
              "combine", "shared rows", "shared recompute", "shared down dgrad", "shared SwiGLU",
              "shared gate/up dgrad", "shared weight gradient",
              "shared combine"});  // kernels::BackwardTaskKind, routed then shared
  return traces;
}

// The forward as a sequence of stages; `mark(name)` is called after each one (profiling).
// Expert parallel (s.ep set, ep_layer.cpp): the routing all-gather and the pull dispatch
// replace the local schedule and gather, and the push combine moves the expert outputs to their
// source ranks before the combine sums this rank's slots.
// The fused local dispatch's arguments (dispatch_local.cuh): the routed rows of `source` [T, H]
// for schedule rows [row_begin, row_begin + rows), into `rows` (at row - row_begin), with the
// ticket, epoch and per-tile counts at `counters` ([2 + max_tiles], zeroed once).
static kernels::FusedGather fused_gather(const GpuLayer::State& s, const TensorView& source,
                                         DeviceBuffer& rows, unsigned long long* counters,
                                         int64_t row_begin, int64_t row_count) {
  kernels::FusedGather gather{};
  gather.x = source.data_as<const __nv_bfloat16>();
  gather.rows = rows.as<__nv_bfloat16>();
  gather.hidden = static_cast<int32_t>(s.shape.hidden);
  gather.top_k = s.shape.top_k;
  gather.ticket = counters;
  gather.epoch = counters + 1;
  gather.tile_rows_done = counters + 2;
  gather.row_begin = row_begin;
  gather.row_end = row_begin + row_count;
  return gather;
}

static void run_forward(GpuLayer::State& s, const ForwardArgs& args, cudaStream_t stream,
                        const StageMarker& mark) {
  const MoeShape& shape = s.shape;
  const int64_t T = shape.num_tokens, H = shape.hidden;
  const int64_t max_rows = s.routed.layout.params.max_rows();
  const int64_t ring_rows = s.ring_rows;
  // The local dispatch (config.local_dispatch): its own kernel, or inside the gate/up GEMM on
  // the producer warpgroup's spare warps. Expert parallel: the received rows are expanded.
  const LocalDispatch dispatch = T > 0 ? s.config.local_dispatch : LocalDispatch::kGatherKernel;
  if (s.ep != nullptr) {
#if MOK_HAS_NCCL
    ep::dispatch_forward(s, args, stream, mark);
#endif
  } else {
    launch_build_schedule(s.routed.layout, args.top_experts.data, args.top_experts.dtype,
                          s.routed.schedule.pointer, stream)
        .throw_if_error();
    mark("schedule");
  }
  // Macrobatches from the last to 0: macrobatch 0's rows, g and u stay in the ring for the
  // backward (kernels/macrobatch.h). A macrobatch past the filled rows does nothing.
  for (int32_t m = s.num_macrobatches - 1; m >= 0; --m) {
    const int64_t row_begin = m * ring_rows;
    kernels::FusedGather gather{};
    if (s.ep != nullptr) {
#if MOK_HAS_NCCL
      ep::expand_received(s, false, args.x.data, s.rows.pointer, row_begin, ring_rows, stream);
#endif
    } else if (dispatch == LocalDispatch::kGatherKernel) {
      const ScheduleView view = s.routed.view();
      cuda_check(
          kernels::launch_gather_rows(view.header, view.row_pair, args.x.data, H, shape.top_k,
                                      s.rows.pointer, ring_rows, stream, row_begin),
          "gather launch");
      mark("gather");
    } else {
      gather = fused_gather(s, args.x, s.rows, s.gather_state.as<unsigned long long>(), row_begin,
                            ring_rows);
    }
    if (s.config.persistent_forward) {
      // The last launch (macrobatch 0) also runs the shared expert's tiles.
      stages::SharedExpertForward shared{args.x.data, args.w_shared_gate.data,
                                         args.w_shared_up.data, args.w_shared_down.data,
                                         s.shared_out.pointer};
      const bool with_shared = m == 0 && shape.has_shared_expert() && T > 0;
      stages::forward_experts_persistent(s, s.routed, s.rows.pointer, ring_rows, args.w_gate.data,
                                         args.w_up.data, args.w_down.data, s.expert_out.pointer,
                                         max_rows, gather, stream, mark, s.macrobatch(m),
                                         with_shared ? &shared : nullptr);
    } else {
      stages::forward_experts(s, s.routed, s.rows.pointer, ring_rows, args.w_gate.data,
                              args.w_up.data, args.w_down.data, s.expert_out.pointer, max_rows,
                              gather, stream, mark, s.macrobatch(m));
    }
  }
#if MOK_HAS_NCCL
  if (s.ep != nullptr) ep::push_rows(s, stream, mark, "push combine");
#endif
  if (shape.has_shared_expert() && T > 0 && !s.config.persistent_forward) {
    stages::forward_experts(s, s.shared, args.x.data, T, args.w_shared_gate.data,
                            args.w_shared_up.data, args.w_shared_down.data, s.shared_out.pointer, T,
                            kernels::FusedGather{}, stream, [](const char*) {});
    mark("shared expert");
  }
  const void* shared = shape.has_shared_expert() ? s.shared_out.pointer : nullptr;
  const float* weights = args.router_weights.data_as<const float>();
#if MOK_HAS_NCCL
  if (s.ep != nullptr)
    ep::combine_slots(s, args.top_experts, shared, weights, args.out.data, stream);
  else
#endif
    cuda_check(kernels::launch_combine(s.expert_out.pointer, s.routed.view().pair_row, shared,
                                       weights, T, H, shape.top_k, args.out.data, stream),
               "combine launch");
  mark("combine");
}

// With `use_context`, the forward that ran last on this layer left the schedule, the gathered x
// rows and g, u of every row (routed and shared) in the workspace: the backward starts from
// them instead of rebuilding and recomputing. Expert parallel: d_out (and x without a context)
// arrive by the pull dispatch, each pair's router-weight gradient is written into its source
// rank's buffer, and the dx rows go back by the push combine.
static void run_backward(GpuLayer::State& s, const BackwardArgs& args, bool use_context,
                         cudaStream_t stream, const StageMarker& mark) {
  const MoeShape& shape = s.shape;
  const ForwardArgs& fwd = args.forward;
  const int64_t T = shape.num_tokens, H = shape.hidden;
  const int64_t max_rows = s.routed.layout.params.max_rows();
  const int64_t ring_rows = s.ring_rows;
  const float* weights = fwd.router_weights.data_as<const float>();
  float* d_router_weights = args.d_router_weights.data_as<float>();
  float* const* d_router_weights_peers = nullptr;
  int32_t pairs_per_rank = 0;
  if (s.ep != nullptr) {
#if MOK_HAS_NCCL
    ep::dispatch_backward(s, args, use_context, stream, mark);
    weights = ep::gathered_router_weights(s);
    d_router_weights = nullptr;
    d_router_weights_peers = ep::router_weight_grad_peers(s);
    pairs_per_rank = static_cast<int32_t>(T * shape.top_k);
#endif
  } else {
    if (!use_context) {
      launch_build_schedule(s.routed.layout, fwd.top_experts.data, fwd.top_experts.dtype,
                            s.routed.schedule.pointer, stream)
          .throw_if_error();
      mark("schedule");
    }
    // Pairs not routed here (expert -1) keep 0; the SwiGLU backward writes the routed ones.
    cuda_check(
        cudaMemsetAsync(args.d_router_weights.data, 0, args.d_router_weights.nbytes(), stream),
        "zero d_router_weights");
  }
  // Macrobatches from 0 to the last (the weight gradients' row order); the ring holds macrobatch
  // 0's x rows, g and u from the forward when the context is used, every other macrobatch is
  // gathered and recomputed (kernels/macrobatch.h).
  const ScheduleView view = s.routed.view();
  const bool persistent = s.config.persistent_backward && s.num_macrobatches == 1;
  // The persistent backward gathers the rows itself (its spare warps, like the forward's fused
  // local dispatch) when the local dispatch is the producer warps' and the rows come from this
  // rank's own tensors.
  const bool gathers_inside =
      persistent && s.ep == nullptr && s.config.local_dispatch == LocalDispatch::kProducerWarps;
  // The persistent backward also runs the shared expert's tasks, in the same ticket stream.
  const bool shared_in_persistent = persistent && shape.has_shared_expert() && T > 0;
  stages::SharedExpertBackward shared_backward;
  if (shared_in_persistent)
    shared_backward = {
        fwd.x.data,
        args.d_out.data,
        fwd.w_shared_gate.data,
        fwd.w_shared_up.data,
        fwd.w_shared_down.data,
        s.shared_out.pointer,
        {args.d_w_shared_gate.data, args.d_w_shared_up.data, args.d_w_shared_down.data}};
  for (int32_t m = 0; m < s.num_macrobatches; ++m) {
    const int64_t row_begin = m * ring_rows;
    const bool recompute = m > 0 || !use_context;
    kernels::FusedGather d_out_gather{}, x_gather{};
    if (gathers_inside) {
      const int64_t max_tiles = s.routed.layout.params.max_tiles();
      unsigned long long* counters = s.persistent_backward_state.as<unsigned long long>() + 2 +
                                     2 * max_tiles + shape.num_local_experts();
      d_out_gather = fused_gather(s, args.d_out, s.d_out_rows, counters, 0, max_rows);
      if (recompute)
        x_gather = fused_gather(s, fwd.x, s.rows, counters + 2 + max_tiles, 0, max_rows);
    } else if (s.ep != nullptr) {
#if MOK_HAS_NCCL
      ep::expand_received(s, true, args.d_out.data, s.d_out_rows.pointer, row_begin, ring_rows,
                          stream);
      if (recompute)
        ep::expand_received(s, false, fwd.x.data, s.rows.pointer, row_begin, ring_rows, stream);
#endif
    } else {
      if (recompute)
        cuda_check(
            kernels::launch_gather_rows(view.header, view.row_pair, fwd.x.data, H, shape.top_k,
                                        s.rows.pointer, ring_rows, stream, row_begin),
            "gather launch");
      cuda_check(
          kernels::launch_gather_rows(view.header, view.row_pair, args.d_out.data, H, shape.top_k,
                                      s.d_out_rows.pointer, ring_rows, stream, row_begin),
          "gather d_out launch");
      mark(recompute ? "gather x, d_out" : "gather d_out");
    }
    if (persistent)
      stages::backward_experts_persistent(
          s, s.routed, s.rows.pointer, s.d_out_rows.pointer, ring_rows, fwd.w_gate.data,
          fwd.w_up.data, fwd.w_down.data, weights, d_router_weights, d_router_weights_peers,
          pairs_per_rank, s.expert_out.pointer, max_rows,
          {args.d_w_gate.data, args.d_w_up.data, args.d_w_down.data}, recompute, d_out_gather,
          x_gather, stream, mark, shared_in_persistent ? &shared_backward : nullptr);
    else
      stages::backward_experts(s, s.routed, s.rows.pointer, s.d_out_rows.pointer, ring_rows,
                               fwd.w_gate.data, fwd.w_up.data, fwd.w_down.data, weights,
                               d_router_weights, d_router_weights_peers, pairs_per_rank,
                               s.expert_out.pointer, max_rows,
                               {args.d_w_gate.data, args.d_w_up.data, args.d_w_down.data},
                               recompute, stream, mark, s.num_macrobatches > 1 ? m : -1);
  }
#if MOK_HAS_NCCL
  if (s.ep != nullptr) ep::push_rows(s, stream, mark, "push dx");
#endif
  if (shape.has_shared_expert() && !shared_in_persistent) {
    if (T > 0) {
      stages::backward_experts(
          s, s.shared, fwd.x.data, args.d_out.data, T, fwd.w_shared_gate.data, fwd.w_shared_up.data,
          fwd.w_shared_down.data, nullptr, nullptr, nullptr, 0, s.shared_out.pointer, T,
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
  const void* shared = shape.has_shared_expert() ? s.shared_out.pointer : nullptr;
  if (s.ep != nullptr) {
#if MOK_HAS_NCCL
    ep::combine_slots(s, fwd.top_experts, shared, nullptr, args.d_x.data, stream);
    ep::copy_router_weight_grads(s, args.d_router_weights, stream);
#endif
  } else {
    cuda_check(kernels::launch_combine(s.expert_out.pointer, s.routed.view().pair_row, shared,
                                       nullptr, T, H, shape.top_k, args.d_x.data, stream),
               "d_x combine launch");
  }
  mark("d_x combine");
}

ForwardContext GpuLayer::forward(const ForwardArgs& args, cudaStream_t stream) {
  State& s = *state_;
  check_forward_args(s.shape, args, DeviceType::kCUDA).throw_if_error();
  if (args.x.device_id != s.device)
    throw Error(ErrorCode::kInvalidArgument,
                "forward: tensors are on cuda:" + std::to_string(args.x.device_id) +
                    " but the layer's workspace is on cuda:" + std::to_string(s.device));
  if (s.config.check_finite)
    cuda_check(kernels::launch_non_finite_scan(forward_input_scan(s.shape, args),
                                               s.non_finite_record.as<unsigned long long>(),
                                               s.sm_count, stream),
               "check_finite: scan of the forward's inputs");
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
  if (s.config.check_finite)
    cuda_check(kernels::launch_non_finite_scan(backward_input_scan(s.shape, args, !use_context),
                                               s.non_finite_record.as<unsigned long long>(),
                                               s.sm_count, stream),
               "check_finite: scan of the backward's inputs");
  run_backward(s, args, use_context, stream, [](const char*) {});
}

namespace {

// Runs `run(mark)` `iterations` times with events at every mark; the median of each stage.
// Refuses a rank of an expert-parallel group: its calls wait for every rank, so one rank's
// synchronizing profile loop would wait for the others until the device timeout.
std::vector<std::pair<std::string, float>> profile_stages(
    const GpuLayer::State& s, const char* who, cudaStream_t stream, int iterations,
    const std::function<void(const StageMarker&)>& run) {
  if (s.ep != nullptr)
    throw Error(ErrorCode::kUnsupported,
                std::string(who) + ": this layer is rank " + std::to_string(s.rank) +
                    " of an expert-parallel group, whose calls wait for every rank; profile a "
                    "single-GPU layer (num_ranks = 1)");
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
  return profile_stages(s, "profile_forward", stream, iterations,
                        [&](const StageMarker& mark) { run_forward(s, args, stream, mark); });
}

std::vector<std::pair<std::string, float>> GpuLayer::profile_backward(
    const BackwardArgs& args, cudaStream_t stream, int iterations, const ForwardContext* context) {
  State& s = *state_;
  check_backward_args(s.shape, args, DeviceType::kCUDA).throw_if_error();
  const bool use_context = context_is_current(s, context);
  if (!use_context) ++s.generation;
  return profile_stages(s, "profile_backward", stream, iterations, [&](const StageMarker& mark) {
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
  // The non-finite record is read and cleared at every synchronize, so that it speaks of the
  // calls since the previous one.
  std::string non_finite;
  if (s.config.check_finite) {
    unsigned long long record = kernels::kNoNonFinite;
    status =
        cudaMemcpy(&record, s.non_finite_record.pointer, sizeof(record), cudaMemcpyDeviceToHost);
    if (status == cudaSuccess && record != kernels::kNoNonFinite) {
      non_finite = describe_non_finite(s.shape, s.rank, record);
      status = cudaMemset(s.non_finite_record.pointer, 0xff, sizeof(record));
    }
    if (status != cudaSuccess)
      return Status{ErrorCode::kCudaError, std::string("reading the non-finite input record: ") +
                                               cudaGetErrorString(status)};
  }
  if (!routing.ok())
    return Status{ErrorCode::kDeviceFault,
                  routing.message + (non_finite.empty() ? "" : "; and " + non_finite)};
  if (!non_finite.empty()) return Status{ErrorCode::kDeviceFault, non_finite};
  return Status::Ok();
}

}  // namespace mok
