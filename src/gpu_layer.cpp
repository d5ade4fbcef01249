// GpuLayer: workspace, tensor maps and launches of the single-GPU layer (include/mok/gpu_layer.h).
//
// Workspace (device memory, allocated once per layer object):
//   schedule     ScheduleLayout of the routing (rank 0 of 1)
//   rows         [max_rows, H] bf16: routed x rows in schedule order (padding rows zero)
//   hidden       [max_rows, I] bf16: h = swiglu(gate, up) per row
//   slots        [T*K, H] bf16: expert output row of each (token, k), read by the combine
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

#include "kernels/launchers.h"
#include "mok/schedule.h"
#include "mok/schedule_gpu.h"
#include "tma.h"
#include "wait_report.h"

namespace mok {

namespace {

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw Error(status == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory : ErrorCode::kCudaError,
                std::string(what) + ": " + cudaGetErrorString(status));
}

struct DeviceBuffer {
  void* pointer = nullptr;
  int64_t bytes = 0;
  void allocate(int64_t size, const char* what) {
    bytes = size;
    cuda_check(cudaMalloc(&pointer, static_cast<size_t>(std::max<int64_t>(size, 16))), what);
  }
  ~DeviceBuffer() {
    if (pointer != nullptr) cudaFree(pointer);
  }
  template <typename T>
  T* as() const {
    return static_cast<T*>(pointer);
  }
};

int64_t round_up(int64_t value, int64_t multiple) { return (value + multiple - 1) / multiple * multiple; }

}  // namespace

struct GpuLayer::State {
  MoeShape shape;
  MoeConfig config;
  int device = 0;
  int sm_count = 0;
  ScheduleLayout schedule_layout;
  DeviceBuffer schedule, rows, hidden, slots;
  DeviceBuffer shared_schedule, shared_hidden, shared_out;
  ScheduleLayout shared_layout;
  kernels::WaitDiagnosis* diagnosis = nullptr;  // mapped pinned host memory
  kernels::WaitDiagnosis* diagnosis_device = nullptr;
  DType expert_dtype = DType::kInt32;

  ~State() {
    if (diagnosis != nullptr) cudaFreeHost(diagnosis);
  }

  kernels::WaitContext wait_context() const {
    return {static_cast<uint64_t>(config.wait_timeout_s * 1e9), 0, diagnosis_device};
  }
};

GpuLayer::GpuLayer(const MoeShape& shape, const MoeConfig& config) : state_(std::make_unique<State>()) {
  can_implement(config, shape).throw_if_error();
  if (shape.num_ranks != 1)
    throw Error(ErrorCode::kUnsupported, "GpuLayer: num_ranks = " + std::to_string(shape.num_ranks) +
                                             " is not supported yet; valid: 1 (multi-GPU comes with the "
                                             "communication layer)");
  State& s = *state_;
  s.shape = shape;
  s.config = config;
  cuda_check(cudaGetDevice(&s.device), "cudaGetDevice");
  cuda_check(cudaDeviceGetAttribute(&s.sm_count, cudaDevAttrMultiProcessorCount, s.device), "SM count");
  int major = 0;
  cuda_check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, s.device), "compute capability");
  if (major != 9)
    throw Error(ErrorCode::kUnsupported, "GpuLayer: device " + std::to_string(s.device) + " has compute capability " +
                                             std::to_string(major) + ".x; mok's kernels need Hopper (9.0, sm_90a)");

  const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate, K = shape.top_k;
  ScheduleParams params;
  params.num_ranks = 1;
  params.tokens_per_rank = static_cast<int32_t>(T);
  params.top_k = shape.top_k;
  params.num_experts = static_cast<int32_t>(shape.num_experts);
  s.schedule_layout = ScheduleLayout::make(params);
  const int64_t max_rows = s.schedule_layout.params.max_rows();
  s.schedule.allocate(s.schedule_layout.total_bytes, "schedule buffer");
  s.rows.allocate(max_rows * H * 2, "routed rows buffer");
  s.hidden.allocate(max_rows * I * 2, "hidden buffer");
  s.slots.allocate(T * K * H * 2, "combine slots buffer");

  if (shape.has_shared_expert()) {
    // The shared expert runs through the same kernels as one expert that every token visits:
    // a fixed schedule with an identity row map, built once here.
    ScheduleParams shared_params;
    shared_params.num_ranks = 1;
    shared_params.tokens_per_rank = static_cast<int32_t>(T);
    shared_params.top_k = 1;
    shared_params.num_experts = 1;
    s.shared_layout = ScheduleLayout::make(shared_params);
    std::vector<int32_t> identity(static_cast<size_t>(T), 0);
    std::vector<char> host(s.shared_layout.output_bytes);
    build_schedule_host(s.shared_layout, identity.data(), DType::kInt32, host.data());
    s.shared_schedule.allocate(s.shared_layout.total_bytes, "shared expert schedule");
    cuda_check(cudaMemcpy(s.shared_schedule.pointer, host.data(), host.size(), cudaMemcpyHostToDevice),
               "upload shared expert schedule");
    s.shared_hidden.allocate(round_up(std::max<int64_t>(T, 1), 128) * shape.shared_intermediate * 2,
                             "shared hidden buffer");
    s.shared_out.allocate(T * H * 2, "shared output buffer");
  }

  cuda_check(cudaHostAlloc(reinterpret_cast<void**>(&s.diagnosis), sizeof(kernels::WaitDiagnosis),
                           cudaHostAllocMapped),
             "diagnosis record");
  *s.diagnosis = kernels::WaitDiagnosis{};
  cuda_check(cudaHostGetDevicePointer(reinterpret_cast<void**>(&s.diagnosis_device), s.diagnosis, 0),
             "diagnosis record device pointer");
}

GpuLayer::~GpuLayer() = default;

const MoeShape& GpuLayer::shape() const { return state_->shape; }

int64_t GpuLayer::workspace_bytes() const {
  const State& s = *state_;
  return s.schedule.bytes + s.rows.bytes + s.hidden.bytes + s.slots.bytes + s.shared_schedule.bytes +
         s.shared_hidden.bytes + s.shared_out.bytes;
}

namespace {

// Runs gate/up + SwiGLU and down for the experts described by `schedule` (a built schedule).
void run_expert_gemms(const GpuLayer& layer, int sm_count, const ScheduleLayout& layout, void* schedule,
                      const void* rows, int64_t num_rows_capacity, const void* w_gate, const void* w_up,
                      const void* w_down, int64_t num_experts, int64_t intermediate, void* hidden,
                      void* out, float swiglu_limit, const kernels::WaitContext& wait, cudaStream_t stream,
                      const std::function<void(const char*)>& mark) {
  const MoeShape& shape = layer.shape();
  const int64_t H = shape.hidden;
  ScheduleView view = ScheduleView::at(schedule, layout);
  const CUtensorMap rows_map = make_tensor_map_2d(rows, H, num_rows_capacity, 64, 128, "routed rows");
  const CUtensorMap gate_map = make_tensor_map_3d(w_gate, H, intermediate, num_experts, 64, 128, "w_gate");
  const CUtensorMap up_map = make_tensor_map_3d(w_up, H, intermediate, num_experts, 64, 128, "w_up");
  const CUtensorMap hidden_map = make_tensor_map_2d(hidden, intermediate, num_rows_capacity, 64, 128, "hidden");
  const CUtensorMap down_map = make_tensor_map_3d(w_down, intermediate, H, num_experts, 64, 256, "w_down");

  kernels::ExpertGemmParams gate_up{};
  gate_up.header = view.header;
  gate_up.tile_expert = view.tile_expert;
  gate_up.row_pair = view.row_pair;
  gate_up.n_extent = static_cast<int32_t>(intermediate);
  gate_up.k_extent = static_cast<int32_t>(H);
  gate_up.out = static_cast<__nv_bfloat16*>(hidden);
  gate_up.out_ld = intermediate;
  gate_up.swiglu_limit = swiglu_limit;
  gate_up.wait = wait;
  cuda_check(kernels::launch_expert_gemm(kernels::ExpertGemmForm::kGateUpSwiGLU, rows_map, gate_map, up_map,
                                         gate_up, sm_count, stream),
             "gate/up GEMM launch");
  mark("gate/up GEMM + SwiGLU");

  kernels::ExpertGemmParams down = gate_up;
  down.n_extent = static_cast<int32_t>(H);
  down.k_extent = static_cast<int32_t>(intermediate);
  down.out = static_cast<__nv_bfloat16*>(out);
  down.out_ld = H;
  cuda_check(kernels::launch_expert_gemm(kernels::ExpertGemmForm::kDownScatter, hidden_map, down_map, down_map,
                                         down, sm_count, stream),
             "down GEMM launch");
  mark("down GEMM + scatter");
}

}  // namespace

namespace {

using StageMarker = std::function<void(const char*)>;

}  // namespace

// The forward as a sequence of stages; `mark(name)` is called after each one (profiling).
static void run_forward(GpuLayer& layer, GpuLayer::State& s, const ForwardArgs& args, cudaStream_t stream,
                        const StageMarker& mark) {
  const MoeShape& shape = s.shape;
  const int64_t T = shape.num_tokens, H = shape.hidden;
  const kernels::WaitContext wait = s.wait_context();
  launch_build_schedule(s.schedule_layout, args.top_experts.data, args.top_experts.dtype, s.schedule.pointer, stream)
      .throw_if_error();
  mark("schedule");
  ScheduleView view = ScheduleView::at(s.schedule.pointer, s.schedule_layout);
  const int64_t max_rows = s.schedule_layout.params.max_rows();
  cuda_check(kernels::launch_gather_rows(view.header, view.row_pair, args.x.data, H, shape.top_k, s.rows.pointer,
                                         max_rows, stream),
             "gather launch");
  mark("gather");
  run_expert_gemms(layer, s.sm_count, s.schedule_layout, s.schedule.pointer, s.rows.pointer, max_rows,
                   args.w_gate.data, args.w_up.data, args.w_down.data, shape.num_local_experts(), shape.intermediate,
                   s.hidden.pointer, s.slots.pointer, shape.swiglu_limit, wait, stream, mark);
  if (shape.has_shared_expert() && T > 0) {
    run_expert_gemms(layer, s.sm_count, s.shared_layout, s.shared_schedule.pointer, args.x.data, T,
                     args.w_shared_gate.data, args.w_shared_up.data, args.w_shared_down.data, 1,
                     shape.shared_intermediate, s.shared_hidden.pointer, s.shared_out.pointer, shape.swiglu_limit,
                     wait, stream, [](const char*) {});
    mark("shared expert");
  }
  cuda_check(kernels::launch_combine(s.slots.pointer, shape.has_shared_expert() ? s.shared_out.pointer : nullptr,
                                     args.top_experts.data, args.top_experts.dtype,
                                     args.router_weights.data_as<const float>(), T, H, shape.top_k,
                                     shape.num_experts, args.out.data, stream),
             "combine launch");
  mark("combine");
}

void GpuLayer::forward(const ForwardArgs& args, cudaStream_t stream) {
  State& s = *state_;
  check_forward_args(s.shape, args, DeviceType::kCUDA).throw_if_error();
  if (args.x.device_id != s.device)
    throw Error(ErrorCode::kInvalidArgument, "forward: tensors are on cuda:" + std::to_string(args.x.device_id) +
                                                 " but the layer's workspace is on cuda:" + std::to_string(s.device));
  run_forward(*this, s, args, stream, [](const char*) {});
}

std::vector<std::pair<std::string, float>> GpuLayer::profile_forward(const ForwardArgs& args, cudaStream_t stream,
                                                                     int iterations) {
  State& s = *state_;
  check_forward_args(s.shape, args, DeviceType::kCUDA).throw_if_error();
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
    run_forward(*this, s, args, stream, [&](const char* name) {
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
      cuda_check(cudaEventElapsedTime(&ms, events[stage], events[stage + 1]), "cudaEventElapsedTime");
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

Status GpuLayer::synchronize(cudaStream_t stream) {
  State& s = *state_;
  cudaError_t status = cudaStreamSynchronize(stream);
  if (s.diagnosis->timed_out != 0) return Status{ErrorCode::kTimeout, describe_wait_diagnosis(*s.diagnosis)};
  if (status != cudaSuccess)
    return Status{ErrorCode::kCudaError, std::string("forward: ") + cudaGetErrorString(status)};
  ScheduleHeader header{};
  ScheduleView view = ScheduleView::at(s.schedule.pointer, s.schedule_layout);
  status = cudaMemcpy(&header, view.header, sizeof(header), cudaMemcpyDeviceToHost);
  if (status != cudaSuccess)
    return Status{ErrorCode::kCudaError, std::string("reading the schedule header: ") + cudaGetErrorString(status)};
  Status routing = schedule_status(s.schedule_layout.params, header);
  if (!routing.ok()) return Status{ErrorCode::kDeviceFault, routing.message};
  return Status::Ok();
}

}  // namespace mok
