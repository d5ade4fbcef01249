// GpuLayer (include/mok/gpu_layer.h): the layer's API and its pipeline. The workspace is
// layer_state.cpp's; what differs between modes is chosen once, when the layer is built: the
// token exchange (layer/token_exchange.h: this GPU alone, or a rank of an expert-parallel group)
// and each direction's engine (layer/expert_engine.h: kernel sequences or persistent kernels).
//
// Forward, per call:                        Backward, per call:
//   exchange.route_forward                    exchange.route_backward
//   for macrobatch m = last .. 0:             for macrobatch m = 0 .. last:
//     exchange.forward_rows(m)                  exchange.backward_rows(m)
//     forward_engine.macrobatch(m)              backward_engine.macrobatch(m)
//   exchange.return_rows                      exchange.return_rows
//   forward_engine.shared_expert              backward_engine.shared_expert
//   exchange.combine -> out                   exchange.combine -> d_x, exchange.finish_backward
#include "mok/gpu_layer.h"

#include <algorithm>
#include <functional>
#include <string>
#include <vector>

#include "kernels/stages/non_finite_scan.h"
#include "layer/cuda_buffer.h"
#include "layer/expert_engine.h"
#include "layer/gpu_layer_state.h"
#include "layer/non_finite_report.h"
#include "layer/token_exchange.h"
#include "layer/wait_report.h"
#include "mok/schedule.h"
#include "mok/sm_clock.h"

namespace mok {

GpuLayer::GpuLayer(const MoeShape& shape, const MoeConfig& config)
    : GpuLayer([&] {
        can_implement(config, shape).throw_if_error();
        if (shape.num_ranks != 1)
          throw Error(ErrorCode::kInvalidArgument,
                      "GpuLayer: num_ranks = " + std::to_string(shape.num_ranks) +
                          "; a GpuLayer runs one GPU on its own (valid: 1); an expert-parallel "
                          "group of several GPUs is an EpLayer (include/mok/ep_layer.h)");
        std::unique_ptr<State> state = make_layer_state(shape, config, 0);
        state->exchange = make_local_exchange(config);
        return state;
      }()) {}

GpuLayer::GpuLayer(std::unique_ptr<State> state) : state_(std::move(state)) {
  State& s = *state_;
  if (s.exchange == nullptr)
    throw Error(ErrorCode::kInternal, "GpuLayer: a layer state without a token exchange");
  s.forward_engine = make_forward_engine(s);
  s.backward_engine = make_backward_engine(s, *s.exchange);
}

GpuLayer::~GpuLayer() = default;

const MoeShape& GpuLayer::shape() const { return state_->shape; }
const MoeConfig& GpuLayer::config() const { return state_->config; }

int64_t GpuLayer::workspace_bytes() const {
  const State& s = *state_;
  return s.routed.bytes() + s.shared.bytes() + s.rows.bytes + s.d_out_rows.bytes +
         s.expert_out.bytes + s.shared_out.bytes + s.gather_state.bytes + s.persistent_state.bytes +
         s.persistent_backward_state.bytes + s.wgrad_partials.bytes + s.forward_trace.bytes +
         s.backward_trace.bytes + s.l2_slot_of_sm.bytes + s.l2_claims.bytes;
}

std::string GpuLayer::l2_placement_report() const { return state_->l2_placement_report; }

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

namespace {

// `expert_strided`: a routed weight, [E, n, k] with its expert stride (else one dense matrix).
Fp8View fp8_view(const Fp8BlockWeight& weight, bool expert_strided) {
  return {weight.codes.data, weight.scales.data_as<const float>(),
          expert_strided && weight.present() ? weight.codes.outer_stride() : 0};
}
ExpertWeights routed_weights(const ForwardArgs& args) {
  return {args.w_gate.data,
          args.w_up.data,
          args.w_down.data,
          args.w_gate.outer_stride(),
          args.w_up.outer_stride(),
          args.w_down.outer_stride(),
          args.weights_version,
          fp8_view(args.w_gate_fp8, true),
          fp8_view(args.w_up_fp8, true),
          fp8_view(args.w_down_fp8, true)};
}
ExpertWeights shared_weights(const ForwardArgs& args) {
  return {args.w_shared_gate.data,
          args.w_shared_up.data,
          args.w_shared_down.data,
          0,
          0,
          0,
          args.weights_version,
          fp8_view(args.w_shared_gate_fp8, false),
          fp8_view(args.w_shared_up_fp8, false),
          fp8_view(args.w_shared_down_fp8, false)};
}

// The pipeline's forward (the diagram at the top); `mark(name)` after each stage (profiles).
void run_forward(GpuLayer::State& s, const ForwardArgs& args, cudaStream_t stream,
                 const StageMarker& mark) {
  const int64_t T = s.shape.num_tokens;
  const ExpertSetForward routed{&s.routed,
                                s.rows.pointer,
                                s.ring_rows,
                                routed_weights(args),
                                s.expert_out.pointer,
                                s.routed.layout.params.max_rows(),
                                s.exchange->gemm_push(s),
                                args.keep_context};
  ExpertSetForward shared_set{&s.shared, args.x.data, T, shared_weights(args), s.shared_out.pointer,
                              T};
  shared_set.keep_context = args.keep_context;
  const ExpertSetForward* shared = s.shape.has_shared_expert() && T > 0 ? &shared_set : nullptr;
  s.exchange->route_forward(s, args, stream, mark);
  // Macrobatches from the last to 0: macrobatch 0's rows, g and u stay in the ring for the
  // backward (kernels/common/macrobatch.h). A macrobatch past the filled rows does nothing.
  for (int32_t m = s.num_macrobatches - 1; m >= 0; --m) {
    const kernels::FusedGather gather = s.exchange->forward_rows(s, args, m, stream, mark);
    s.forward_engine->macrobatch(s, routed, m == 0 ? shared : nullptr, gather, m, stream, mark);
  }
  s.exchange->return_rows(s, stream, mark, "push combine");
  s.forward_engine->shared_expert(s, shared, stream, mark);
  s.exchange->combine(s, args.top_experts,
                      s.shape.has_shared_expert() ? s.shared_out.pointer : nullptr,
                      args.router_weights.data_as<const float>(), args.out.data, stream);
  mark("combine");
}

// Where an expert set's backward writes its weight gradients; `expert_strided`: [E, rows, cols]
// views with their expert strides (the routed set), else one dense matrix each (the shared
// expert).
WeightGrads weight_grads(const TensorView& gate, const TensorView& up, const TensorView& down,
                         bool accumulate, bool expert_strided) {
  WeightGrads grads;
  grads.d_w_gate = gate.data;
  grads.d_w_up = up.data;
  grads.d_w_down = down.data;
  if (expert_strided && gate.present()) {
    grads.d_w_gate_stride = gate.outer_stride();
    grads.d_w_up_stride = up.outer_stride();
    grads.d_w_down_stride = down.outer_stride();
  }
  grads.d_w_gate_f32 = gate.present() && gate.dtype == DType::kFloat32;
  grads.d_w_up_f32 = up.present() && up.dtype == DType::kFloat32;
  grads.d_w_down_f32 = down.present() && down.dtype == DType::kFloat32;
  grads.accumulate = accumulate;
  return grads;
}

// The pipeline's backward. With `use_context`, the forward that ran last on this layer left the
// schedule, the gathered x rows and g, u of every row (routed and shared) in the workspace: the
// backward starts from them instead of rebuilding and recomputing.
void run_backward(GpuLayer::State& s, const BackwardArgs& args, bool use_context,
                  cudaStream_t stream, const StageMarker& mark) {
  const ForwardArgs& fwd = args.forward;
  const int64_t T = s.shape.num_tokens;
  const RouterWeightRoute router = s.exchange->route_backward(s, args, use_context, stream, mark);
  const ExpertSetBackward routed{
      &s.routed,
      s.rows.pointer,
      s.d_out_rows.pointer,
      s.ring_rows,
      routed_weights(fwd),
      router,
      s.expert_out.pointer,
      s.routed.layout.params.max_rows(),
      weight_grads(args.d_w_gate, args.d_w_up, args.d_w_down, args.accumulate_weight_grads, true),
      s.exchange->gemm_push(s)};
  const ExpertSetBackward shared_set{
      &s.shared,
      fwd.x.data,
      args.d_out.data,
      T,
      shared_weights(fwd),
      RouterWeightRoute{},
      s.shared_out.pointer,
      T,
      weight_grads(args.d_w_shared_gate, args.d_w_shared_up, args.d_w_shared_down,
                   args.accumulate_weight_grads, false)};
  const ExpertSetBackward* shared = s.shape.has_shared_expert() && T > 0 ? &shared_set : nullptr;
  // Macrobatches from 0 to the last (the weight gradients' row order); the ring holds macrobatch
  // 0's x rows, g and u from the forward when the context is used, every other macrobatch is
  // gathered and recomputed (kernels/common/macrobatch.h).
  const bool in_kernel = s.backward_engine->gathers_in_kernel();
  for (int32_t m = 0; m < s.num_macrobatches; ++m) {
    const bool recompute = m > 0 || !use_context;
    const BackwardRows rows =
        s.exchange->backward_rows(s, args, m, recompute, in_kernel, stream, mark);
    s.backward_engine->macrobatch(s, routed, m == 0 ? shared : nullptr, recompute, rows, m, stream,
                                  mark);
  }
  s.exchange->return_rows(s, stream, mark, "push dx");
  s.backward_engine->shared_expert(s, shared, !use_context, stream, mark);
  // No tokens: the shared expert's gradients are zeros (nothing to add when they accumulate).
  if (s.shape.has_shared_expert() && T == 0 && wants_weight_gradients(args) &&
      !args.accumulate_weight_grads) {
    for (const TensorView* grad :
         {&args.d_w_shared_gate, &args.d_w_shared_up, &args.d_w_shared_down})
      cuda_check(cudaMemsetAsync(grad->data, 0, grad->nbytes(), stream),
                 "zero shared weight gradients");
    mark("shared expert");
  }
  s.exchange->combine(s, fwd.top_experts,
                      s.shape.has_shared_expert() ? s.shared_out.pointer : nullptr, nullptr,
                      args.d_x.data, stream);
  s.exchange->finish_backward(s, args, stream);
  mark("d_x combine");
}

}  // namespace

ForwardContext GpuLayer::forward(const ForwardArgs& args, cudaStream_t stream) {
  State& s = *state_;
  check_forward_args(s.shape, args, DeviceType::kCUDA).throw_if_error();
  check_weight_precision("forward", args, s.config.precision).throw_if_error();
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
  ++s.generation;  // the workspace's intermediates are this forward's now
  // Without keep_context, g and u (and FP8's x column groups) were not written: generation 0,
  // which no backward accepts.
  return args.keep_context ? ForwardContext{s.generation} : ForwardContext{};
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

namespace {

// Frozen weights (no weight gradients asked for) with an engine that cannot skip them.
void check_frozen_weights(const GpuLayer::State& s, const BackwardArgs& args, const char* call) {
  if (wants_weight_gradients(args) || s.backward_engine->skips_weight_gradients()) return;
  throw Error(ErrorCode::kInvalidArgument,
              std::string(call) +
                  ": the weight gradients are absent (frozen weights), which the persistent "
                  "backward (MoeConfig::persistent_backward) computes in its one launch; pass "
                  "them, or turn persistent_backward off");
}

}  // namespace

bool GpuLayer::holds_context(const ForwardContext& context) const {
  return context.generation != 0 && context.generation == state_->generation;
}

void GpuLayer::backward(const BackwardArgs& args, cudaStream_t stream,
                        const ForwardContext* context) {
  State& s = *state_;
  check_backward_args(s.shape, args, DeviceType::kCUDA).throw_if_error();
  check_backward_precision("backward", args, s.config.precision).throw_if_error();
  check_frozen_weights(s, args, "backward");
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

// Runs `run(mark)` `iterations` times with events and clock probes (mok/sm_clock.h) at every
// mark; the median time and SM clock of each stage. The probes are launches of their own, so
// each stage's time includes one (a few microseconds).
// Refuses a rank of an expert-parallel group: its calls wait for every rank, so one rank's
// synchronizing profile loop would wait for the others until the device timeout.
std::vector<StageTime> profile_stages(const GpuLayer::State& s, const char* who,
                                      cudaStream_t stream, int iterations,
                                      const std::function<void(const StageMarker&)>& run) {
  if (!s.exchange->profiles())
    throw Error(ErrorCode::kUnsupported,
                std::string(who) + ": this layer is rank " + std::to_string(s.rank) +
                    " of an expert-parallel group, whose calls wait for every rank; profile a "
                    "single-GPU layer (num_ranks = 1)");
  std::vector<std::string> names;
  std::vector<std::vector<float>> samples, clocks;
  std::vector<cudaEvent_t> events;
  auto event_at = [&](size_t index) {
    while (events.size() <= index) {
      cudaEvent_t event;
      cuda_check(cudaEventCreate(&event), "cudaEventCreate");
      events.push_back(event);
    }
    return events[index];
  };
  // One clock probe per mark (a run marks a dozen stages at most).
  constexpr int kMaxMarks = 64;
  SmClockWindow clock(kMaxMarks);
  for (int iteration = 0; iteration < iterations; ++iteration) {
    size_t marker = 0;
    auto mark_here = [&] {
      clock.mark(static_cast<int>(marker), stream);
      cuda_check(cudaEventRecord(event_at(marker), stream), "cudaEventRecord");
      ++marker;
    };
    mark_here();
    std::vector<std::string> stage_names;
    run([&](const char* name) {
      mark_here();
      stage_names.push_back(name);
    });
    cuda_check(cudaStreamSynchronize(stream), "profile synchronize");
    if (iteration == 0) {
      names = stage_names;
      names.push_back("total");
      samples.assign(names.size(), {});
      clocks.assign(names.size(), {});
    }
    auto clock_between = [&](size_t first, size_t last) {
      return static_cast<float>(clock.ghz(static_cast<int>(first), static_cast<int>(last)));
    };
    for (size_t stage = 0; stage + 1 < marker; ++stage) {
      float ms = 0;
      cuda_check(cudaEventElapsedTime(&ms, events[stage], events[stage + 1]),
                 "cudaEventElapsedTime");
      samples[stage].push_back(ms);
      clocks[stage].push_back(clock_between(stage, stage + 1));
    }
    float total = 0;
    cuda_check(cudaEventElapsedTime(&total, events[0], events[marker - 1]), "cudaEventElapsedTime");
    samples.back().push_back(total);
    clocks.back().push_back(clock_between(0, marker - 1));
  }
  for (cudaEvent_t event : events) cudaEventDestroy(event);
  auto median = [](std::vector<float>& values) {
    std::sort(values.begin(), values.end());
    return values.empty() ? 0.0f : values[values.size() / 2];
  };
  std::vector<StageTime> medians;
  for (size_t stage = 0; stage < names.size(); ++stage)
    medians.push_back({names[stage], median(samples[stage]), median(clocks[stage])});
  return medians;
}

}  // namespace

std::vector<StageTime> GpuLayer::profile_forward(const ForwardArgs& args, cudaStream_t stream,
                                                 int iterations) {
  State& s = *state_;
  check_forward_args(s.shape, args, DeviceType::kCUDA).throw_if_error();
  check_weight_precision("forward", args, s.config.precision).throw_if_error();
  return profile_stages(s, "profile_forward", stream, iterations,
                        [&](const StageMarker& mark) { run_forward(s, args, stream, mark); });
}

std::vector<StageTime> GpuLayer::profile_backward(const BackwardArgs& args, cudaStream_t stream,
                                                  int iterations, const ForwardContext* context) {
  State& s = *state_;
  check_backward_args(s.shape, args, DeviceType::kCUDA).throw_if_error();
  check_backward_precision("backward", args, s.config.precision).throw_if_error();
  check_frozen_weights(s, args, "profile_backward");
  const bool use_context = context_is_current(s, context);
  if (!use_context) ++s.generation;
  return profile_stages(s, "profile_backward", stream, iterations, [&](const StageMarker& mark) {
    run_backward(s, args, use_context, stream, mark);
  });
}

std::string GpuLayer::timed_out_wait() const {
  const State& s = *state_;
  return s.diagnosis->timed_out != 0 ? describe_wait_diagnosis(*s.diagnosis) : std::string();
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
