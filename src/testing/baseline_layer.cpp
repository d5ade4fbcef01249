// BaselineLayer: see include/mok/baseline_layer.h. cuBLAS computes each expert's GEMMs in
// column-major terms: C^T[n x c] = W[n x k] * rows^T[k x c], i.e. op(W) = T on the row-major
// weight, with fp32 accumulation and bf16 output (the same rounding points as mok).
#include "mok/testing/baseline_layer.h"

#include <cublas_v2.h>

#include <string>
#include <vector>

#include "kernels/stages/launch.h"
#include "layer/cuda_buffer.h"
#include "mok/schedule.h"
#include "mok/schedule_gpu.h"
#include "testing/baseline_kernels.h"

namespace mok {

namespace {

void cublas_check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw Error(ErrorCode::kCudaError,
                std::string("baseline: ") + what + ": cuBLAS status " + std::to_string(status));
}

constexpr float kOne = 1.0f, kZero = 0.0f;

// out[count x n] = rows[count x k] * W where W is row-major [k x n] (the dgrad forms).
void gemm_rows_by_weights(cublasHandle_t handle, int64_t count, int64_t n, int64_t k,
                          const void* weights, const void* rows, void* out, const float* beta) {
  cublas_check(
      cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(count),
                   static_cast<int>(k), &kOne, weights, CUDA_R_16BF, static_cast<int>(n), rows,
                   CUDA_R_16BF, static_cast<int>(k), beta, out, CUDA_R_16BF, static_cast<int>(n),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx (dgrad)");
}

// out[m x n] (row-major) = a[count x m]^T * b[count x n]: a weight gradient over `count` rows.
void gemm_weight_grad(cublasHandle_t handle, int64_t count, int64_t m, int64_t n, const void* a,
                      const void* b, void* out) {
  cublas_check(
      cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(n), static_cast<int>(m),
                   static_cast<int>(count), &kOne, b, CUDA_R_16BF, static_cast<int>(n), a,
                   CUDA_R_16BF, static_cast<int>(m), &kZero, out, CUDA_R_16BF, static_cast<int>(n),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx (weight gradient)");
}

// rows[count x k] (row-major, ld k) times weights[n x k]^T into out[count x n].
void gemm_rows_by_weights_t(cublasHandle_t handle, int64_t count, int64_t n, int64_t k,
                            const void* weights, const void* rows, void* out) {
  const float one = 1.0f, zero = 0.0f;
  cublas_check(
      cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(count),
                   static_cast<int>(k), &one, weights, CUDA_R_16BF, static_cast<int>(k), rows,
                   CUDA_R_16BF, static_cast<int>(k), &zero, out, CUDA_R_16BF, static_cast<int>(n),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      "cublasGemmEx");
}

}  // namespace

struct BaselineLayer::State {
  MoeShape shape;
  cublasHandle_t handle = nullptr;
  ScheduleLayout layout;
  std::unique_ptr<DeviceBuffer> schedule, rows, gate, up, hidden, expert_out, shared_gate,
      shared_up, shared_hidden, shared_out;
  std::vector<int32_t> offsets, counts;  // split sizes read by the last forward
  // Backward only (allocated on first use).
  std::unique_ptr<DeviceBuffer> d_out_rows, dh_raw, d_gate, d_up, shared_dh_raw, shared_d_gate,
      shared_d_up;
  ~State() {
    if (handle != nullptr) cublasDestroy(handle);
  }
};

BaselineLayer::BaselineLayer(const MoeShape& shape) : state_(std::make_unique<State>()) {
  can_implement(shape).throw_if_error();
  if (shape.num_ranks != 1)
    throw Error(ErrorCode::kUnsupported,
                "BaselineLayer: num_ranks = " + std::to_string(shape.num_ranks) + "; valid: 1");
  State& s = *state_;
  s.shape = shape;
  cublas_check(cublasCreate(&s.handle), "cublasCreate");
  const ScheduleParams params = schedule_params(shape);
  s.layout = ScheduleLayout::make(params);
  const int64_t max_rows = params.max_rows(), H = shape.hidden, I = shape.intermediate,
                T = shape.num_tokens;
  s.schedule = std::make_unique<DeviceBuffer>(s.layout.total_bytes, "baseline buffer");
  s.rows = std::make_unique<DeviceBuffer>(max_rows * H * 2, "baseline buffer");
  s.gate = std::make_unique<DeviceBuffer>(max_rows * I * 2, "baseline buffer");
  s.up = std::make_unique<DeviceBuffer>(max_rows * I * 2, "baseline buffer");
  s.hidden = std::make_unique<DeviceBuffer>(max_rows * I * 2, "baseline buffer");
  s.expert_out = std::make_unique<DeviceBuffer>(max_rows * H * 2, "baseline buffer");
  if (shape.has_shared_expert()) {
    const int64_t Is = shape.shared_intermediate;
    s.shared_gate = std::make_unique<DeviceBuffer>(T * Is * 2, "baseline buffer");
    s.shared_up = std::make_unique<DeviceBuffer>(T * Is * 2, "baseline buffer");
    s.shared_hidden = std::make_unique<DeviceBuffer>(T * Is * 2, "baseline buffer");
    s.shared_out = std::make_unique<DeviceBuffer>(T * H * 2, "baseline buffer");
  }
}

BaselineLayer::~BaselineLayer() = default;

// Sorts the routed pairs by expert (the schedule), reads the split sizes on the host (the
// synchronization the user's pipeline pays) and permutes x into expert order.
static void sort_and_permute(BaselineLayer::State& s, const ForwardArgs& args,
                             cudaStream_t stream) {
  const int64_t E = s.shape.num_experts;
  launch_build_schedule(s.layout, args.top_experts.data, args.top_experts.dtype,
                        s.schedule->pointer, stream)
      .throw_if_error();
  const ScheduleView view = ScheduleView::at(s.schedule->pointer, s.layout);
  s.offsets.resize(E + 1);
  s.counts.resize(E);
  cuda_check(cudaMemcpyAsync(s.offsets.data(), view.expert_offsets, (E + 1) * 4,
                             cudaMemcpyDeviceToHost, stream),
             "read offsets");
  cuda_check(
      cudaMemcpyAsync(s.counts.data(), view.expert_counts, E * 4, cudaMemcpyDeviceToHost, stream),
      "read counts");
  cuda_check(cudaStreamSynchronize(stream), "baseline: host sync for split sizes");
  cuda_check(kernels::launch_gather_rows(view.header, view.row_pair, args.x.data, s.shape.hidden,
                                         s.shape.top_k, s.rows->pointer, s.layout.params.max_rows(),
                                         stream),
             "permute x");
}

void BaselineLayer::forward(const ForwardArgs& args, cudaStream_t stream) {
  State& s = *state_;
  const MoeShape& shape = s.shape;
  check_forward_args(shape, args, DeviceType::kCUDA).throw_if_error();
  const int64_t H = shape.hidden, I = shape.intermediate, T = shape.num_tokens,
                E = shape.num_experts;
  cublas_check(cublasSetStream(s.handle, stream), "cublasSetStream");

  sort_and_permute(s, args, stream);
  const ScheduleView view = ScheduleView::at(s.schedule->pointer, s.layout);
  const std::vector<int32_t>& offsets = s.offsets;
  const std::vector<int32_t>& counts = s.counts;
  const char* w_gate = static_cast<const char*>(args.w_gate.data);
  const char* w_up = static_cast<const char*>(args.w_up.data);
  const char* w_down = static_cast<const char*>(args.w_down.data);
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] == 0) continue;
    const int64_t row = offsets[e];
    gemm_rows_by_weights_t(s.handle, counts[e], I, H, w_gate + e * I * H * 2,
                           s.rows->as<char>() + row * H * 2, s.gate->as<char>() + row * I * 2);
    gemm_rows_by_weights_t(s.handle, counts[e], I, H, w_up + e * I * H * 2,
                           s.rows->as<char>() + row * H * 2, s.up->as<char>() + row * I * 2);
  }
  cuda_check(kernels::launch_baseline_swiglu(offsets[E], s.gate->pointer, s.up->pointer, I,
                                             shape.swiglu_limit, s.hidden->pointer, stream),
             "swiglu");
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] == 0) continue;
    const int64_t row = offsets[e];
    gemm_rows_by_weights_t(s.handle, counts[e], H, I, w_down + e * H * I * 2,
                           s.hidden->as<char>() + row * I * 2,
                           s.expert_out->as<char>() + row * H * 2);
  }
  if (shape.has_shared_expert() && T > 0) {
    const int64_t Is = shape.shared_intermediate;
    gemm_rows_by_weights_t(s.handle, T, Is, H, args.w_shared_gate.data, args.x.data,
                           s.shared_gate->pointer);
    gemm_rows_by_weights_t(s.handle, T, Is, H, args.w_shared_up.data, args.x.data,
                           s.shared_up->pointer);
    cuda_check(
        kernels::launch_baseline_swiglu(T, s.shared_gate->pointer, s.shared_up->pointer, Is,
                                        shape.swiglu_limit, s.shared_hidden->pointer, stream),
        "shared swiglu");
    gemm_rows_by_weights_t(s.handle, T, H, Is, args.w_shared_down.data, s.shared_hidden->pointer,
                           s.shared_out->pointer);
  }
  cuda_check(kernels::launch_combine(s.expert_out->pointer, view.pair_row,
                                     shape.has_shared_expert() ? s.shared_out->pointer : nullptr,
                                     args.router_weights.data_as<const float>(), T, H, shape.top_k,
                                     args.out.data, stream),
             "unpermute");
}

}  // namespace mok

namespace mok {

void BaselineLayer::backward(const BackwardArgs& args, cudaStream_t stream,
                             bool saved_activations) {
  State& s = *state_;
  const MoeShape& shape = s.shape;
  check_backward_args(shape, args, DeviceType::kCUDA).throw_if_error();
  // The baseline writes bf16 weight gradients, as the bf16 layer does.
  check_backward_precision("baseline backward", args, Precision::kBF16).throw_if_error();
  const ForwardArgs& fwd = args.forward;
  const int64_t H = shape.hidden, I = shape.intermediate, T = shape.num_tokens,
                E = shape.num_experts;
  const int64_t max_rows = s.layout.params.max_rows();
  if (!s.d_out_rows) {
    s.d_out_rows = std::make_unique<DeviceBuffer>(max_rows * H * 2, "baseline buffer");
    s.dh_raw = std::make_unique<DeviceBuffer>(max_rows * I * 2, "baseline buffer");
    s.d_gate = std::make_unique<DeviceBuffer>(max_rows * I * 2, "baseline buffer");
    s.d_up = std::make_unique<DeviceBuffer>(max_rows * I * 2, "baseline buffer");
    if (shape.has_shared_expert()) {
      const int64_t Is = shape.shared_intermediate;
      s.shared_dh_raw = std::make_unique<DeviceBuffer>(T * Is * 2, "baseline buffer");
      s.shared_d_gate = std::make_unique<DeviceBuffer>(T * Is * 2, "baseline buffer");
      s.shared_d_up = std::make_unique<DeviceBuffer>(T * Is * 2, "baseline buffer");
    }
  }
  cublas_check(cublasSetStream(s.handle, stream), "cublasSetStream");
  ScheduleView view = ScheduleView::at(s.schedule->pointer, s.layout);
  if (!saved_activations || s.offsets.empty()) {
    saved_activations = false;
    sort_and_permute(s, fwd, stream);
  }
  const std::vector<int32_t>& offsets = s.offsets;
  const std::vector<int32_t>& counts = s.counts;
  cuda_check(kernels::launch_gather_rows(view.header, view.row_pair, args.d_out.data, H,
                                         shape.top_k, s.d_out_rows->pointer, max_rows, stream),
             "permute d_out");
  cuda_check(cudaMemsetAsync(args.d_router_weights.data, 0, args.d_router_weights.nbytes(), stream),
             "zero d_rw");
  const char* w_gate = static_cast<const char*>(fwd.w_gate.data);
  const char* w_up = static_cast<const char*>(fwd.w_up.data);
  const char* w_down = static_cast<const char*>(fwd.w_down.data);
  char* d_w_gate = static_cast<char*>(args.d_w_gate.data);
  char* d_w_up = static_cast<char*>(args.d_w_up.data);
  char* d_w_down = static_cast<char*>(args.d_w_down.data);
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] == 0) continue;
    const int64_t row = offsets[e];
    if (!saved_activations) {
      gemm_rows_by_weights_t(s.handle, counts[e], I, H, w_gate + e * I * H * 2,
                             s.rows->as<char>() + row * H * 2, s.gate->as<char>() + row * I * 2);
      gemm_rows_by_weights_t(s.handle, counts[e], I, H, w_up + e * I * H * 2,
                             s.rows->as<char>() + row * H * 2, s.up->as<char>() + row * I * 2);
    }
    gemm_rows_by_weights(s.handle, counts[e], I, H, w_down + e * H * I * 2,
                         s.d_out_rows->as<char>() + row * H * 2, s.dh_raw->as<char>() + row * I * 2,
                         &kZero);
  }
  cuda_check(kernels::launch_swiglu_backward(
                 nullptr, offsets[E], s.gate->pointer, s.up->pointer, s.dh_raw->pointer,
                 view.row_pair, fwd.router_weights.data_as<const float>(), I, shape.swiglu_limit,
                 s.d_gate->pointer, s.d_up->pointer, s.hidden->pointer,
                 args.d_router_weights.data_as<float>(), nullptr, 0, stream),
             "swiglu backward");
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] == 0) {
      for (char* grad :
           {d_w_gate + e * I * H * 2, d_w_up + e * I * H * 2, d_w_down + e * H * I * 2})
        cuda_check(cudaMemsetAsync(grad, 0, I * H * 2, stream),
                   "baseline: zero empty expert gradient");
      continue;
    }
    const int64_t row = offsets[e];
    char* dx = s.expert_out->as<char>() + row * H * 2;
    gemm_rows_by_weights(s.handle, counts[e], H, I, w_gate + e * I * H * 2,
                         s.d_gate->as<char>() + row * I * 2, dx, &kZero);
    gemm_rows_by_weights(s.handle, counts[e], H, I, w_up + e * I * H * 2,
                         s.d_up->as<char>() + row * I * 2, dx, &kOne);
    gemm_weight_grad(s.handle, counts[e], I, H, s.d_gate->as<char>() + row * I * 2,
                     s.rows->as<char>() + row * H * 2, d_w_gate + e * I * H * 2);
    gemm_weight_grad(s.handle, counts[e], I, H, s.d_up->as<char>() + row * I * 2,
                     s.rows->as<char>() + row * H * 2, d_w_up + e * I * H * 2);
    gemm_weight_grad(s.handle, counts[e], H, I, s.d_out_rows->as<char>() + row * H * 2,
                     s.hidden->as<char>() + row * I * 2, d_w_down + e * H * I * 2);
  }
  if (shape.has_shared_expert()) {
    const int64_t Is = shape.shared_intermediate;
    if (T == 0) {
      for (const TensorView* grad :
           {&args.d_w_shared_gate, &args.d_w_shared_up, &args.d_w_shared_down})
        cuda_check(cudaMemsetAsync(grad->data, 0, grad->nbytes(), stream),
                   "baseline: zero shared gradients");
    } else {
      if (!saved_activations) {
        gemm_rows_by_weights_t(s.handle, T, Is, H, fwd.w_shared_gate.data, fwd.x.data,
                               s.shared_gate->pointer);
        gemm_rows_by_weights_t(s.handle, T, Is, H, fwd.w_shared_up.data, fwd.x.data,
                               s.shared_up->pointer);
      }
      gemm_rows_by_weights(s.handle, T, Is, H, fwd.w_shared_down.data, args.d_out.data,
                           s.shared_dh_raw->pointer, &kZero);
      cuda_check(
          kernels::launch_swiglu_backward(
              nullptr, T, s.shared_gate->pointer, s.shared_up->pointer, s.shared_dh_raw->pointer,
              nullptr, nullptr, Is, shape.swiglu_limit, s.shared_d_gate->pointer,
              s.shared_d_up->pointer, s.shared_hidden->pointer, nullptr, nullptr, 0, stream),
          "shared swiglu backward");
      gemm_rows_by_weights(s.handle, T, H, Is, fwd.w_shared_gate.data, s.shared_d_gate->pointer,
                           s.shared_out->pointer, &kZero);
      gemm_rows_by_weights(s.handle, T, H, Is, fwd.w_shared_up.data, s.shared_d_up->pointer,
                           s.shared_out->pointer, &kOne);
      gemm_weight_grad(s.handle, T, Is, H, s.shared_d_gate->pointer, fwd.x.data,
                       args.d_w_shared_gate.data);
      gemm_weight_grad(s.handle, T, Is, H, s.shared_d_up->pointer, fwd.x.data,
                       args.d_w_shared_up.data);
      gemm_weight_grad(s.handle, T, H, Is, args.d_out.data, s.shared_hidden->pointer,
                       args.d_w_shared_down.data);
    }
  }
  cuda_check(
      kernels::launch_combine(s.expert_out->pointer, view.pair_row,
                              shape.has_shared_expert() && T > 0 ? s.shared_out->pointer : nullptr,
                              nullptr, T, H, shape.top_k, args.d_x.data, stream),
      "unpermute d_x");
}

}  // namespace mok
