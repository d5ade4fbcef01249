// DeviceProblem: see include/mok/device_problem.h.
#include "mok/device_problem.h"

#include <cuda_runtime_api.h>

#include <string>

namespace mok {

namespace {

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw Error(
        status == cudaErrorMemoryAllocation ? ErrorCode::kOutOfMemory : ErrorCode::kCudaError,
        std::string("DeviceProblem: ") + what + ": " + cudaGetErrorString(status));
}

struct DeviceArray {
  void* pointer = nullptr;
  size_t bytes = 0;
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  ~DeviceArray() {
    if (pointer != nullptr) cudaFree(pointer);
  }
  template <typename T>
  void upload(const std::vector<T>& host, const char* what) {
    allocate(host.size() * sizeof(T), what);
    if (bytes > 0) check(cudaMemcpy(pointer, host.data(), bytes, cudaMemcpyHostToDevice), what);
  }
  void allocate(size_t size, const char* what) {
    bytes = size;
    check(cudaMalloc(&pointer, size > 0 ? size : 16), what);
  }
  template <typename T>
  void download(std::vector<T>& host, const char* what) const {
    if (host.size() * sizeof(T) != bytes)
      throw Error(ErrorCode::kInvalidArgument, std::string("DeviceProblem: host buffer for ") +
                                                   what + " has " +
                                                   std::to_string(host.size() * sizeof(T)) +
                                                   " bytes; expected " + std::to_string(bytes));
    if (bytes > 0) check(cudaMemcpy(host.data(), pointer, bytes, cudaMemcpyDeviceToHost), what);
  }
};

TensorView cuda_view(const DeviceArray& array, DType dtype, std::initializer_list<int64_t> shape,
                     bool present = true) {
  if (!present) return TensorView{};
  int device = 0;
  cudaGetDevice(&device);
  return TensorView::contiguous(array.pointer, dtype, shape, DeviceType::kCUDA, device);
}

}  // namespace

struct DeviceProblem::Buffers {
  DeviceArray x, d_out, top_experts, router_weights, w_gate, w_up, w_down, w_shared_gate,
      w_shared_up, w_shared_down;
  DeviceArray out, d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, d_w_shared_gate,
      d_w_shared_up, d_w_shared_down;
  DeviceArray* outputs[9] = {&out,
                             &d_x,
                             &d_router_weights,
                             &d_w_gate,
                             &d_w_up,
                             &d_w_down,
                             &d_w_shared_gate,
                             &d_w_shared_up,
                             &d_w_shared_down};
};

DeviceProblem::DeviceProblem(const HostProblem& problem, int32_t rank)
    : shape_(problem.shape), buffers_(std::make_unique<Buffers>()) {
  if (rank < 0 || rank >= static_cast<int32_t>(problem.ranks.size()))
    throw Error(ErrorCode::kInvalidArgument, "DeviceProblem: rank = " + std::to_string(rank) +
                                                 "; valid: 0.." +
                                                 std::to_string(problem.ranks.size() - 1));
  const HostRank& host = problem.ranks[rank];
  Buffers& b = *buffers_;
  b.x.upload(host.x, "x");
  b.d_out.upload(host.d_out, "d_out");
  b.top_experts.upload(host.top_experts, "top_experts");
  b.router_weights.upload(host.router_weights, "router_weights");
  b.w_gate.upload(host.w_gate, "w_gate");
  b.w_up.upload(host.w_up, "w_up");
  b.w_down.upload(host.w_down, "w_down");
  b.w_shared_gate.upload(host.w_shared_gate, "w_shared_gate");
  b.w_shared_up.upload(host.w_shared_up, "w_shared_up");
  b.w_shared_down.upload(host.w_shared_down, "w_shared_down");
  b.out.allocate(host.out.size() * 2, "out");
  b.d_x.allocate(host.d_x.size() * 2, "d_x");
  b.d_router_weights.allocate(host.d_router_weights.size() * 4, "d_router_weights");
  b.d_w_gate.allocate(host.d_w_gate.size() * 2, "d_w_gate");
  b.d_w_up.allocate(host.d_w_up.size() * 2, "d_w_up");
  b.d_w_down.allocate(host.d_w_down.size() * 2, "d_w_down");
  b.d_w_shared_gate.allocate(host.d_w_shared_gate.size() * 2, "d_w_shared_gate");
  b.d_w_shared_up.allocate(host.d_w_shared_up.size() * 2, "d_w_shared_up");
  b.d_w_shared_down.allocate(host.d_w_shared_down.size() * 2, "d_w_shared_down");
}

DeviceProblem::~DeviceProblem() = default;

ForwardArgs DeviceProblem::forward_args() {
  const int64_t T = shape_.num_tokens, H = shape_.hidden, I = shape_.intermediate, K = shape_.top_k,
                E = shape_.num_local_experts(), Is = shape_.shared_intermediate;
  const bool shared = shape_.has_shared_expert();
  Buffers& b = *buffers_;
  ForwardArgs args;
  args.x = cuda_view(b.x, DType::kBFloat16, {T, H});
  args.top_experts = cuda_view(b.top_experts, DType::kInt32, {T, K});
  args.router_weights = cuda_view(b.router_weights, DType::kFloat32, {T, K});
  args.w_gate = cuda_view(b.w_gate, DType::kBFloat16, {E, I, H});
  args.w_up = cuda_view(b.w_up, DType::kBFloat16, {E, I, H});
  args.w_down = cuda_view(b.w_down, DType::kBFloat16, {E, H, I});
  args.w_shared_gate = cuda_view(b.w_shared_gate, DType::kBFloat16, {Is, H}, shared);
  args.w_shared_up = cuda_view(b.w_shared_up, DType::kBFloat16, {Is, H}, shared);
  args.w_shared_down = cuda_view(b.w_shared_down, DType::kBFloat16, {H, Is}, shared);
  args.out = cuda_view(b.out, DType::kBFloat16, {T, H});
  return args;
}

BackwardArgs DeviceProblem::backward_args() {
  const int64_t T = shape_.num_tokens, H = shape_.hidden, I = shape_.intermediate, K = shape_.top_k,
                E = shape_.num_local_experts(), Is = shape_.shared_intermediate;
  const bool shared = shape_.has_shared_expert();
  Buffers& b = *buffers_;
  BackwardArgs args;
  args.forward = forward_args();
  args.forward.out = TensorView{};
  args.d_out = cuda_view(b.d_out, DType::kBFloat16, {T, H});
  args.d_x = cuda_view(b.d_x, DType::kBFloat16, {T, H});
  args.d_router_weights = cuda_view(b.d_router_weights, DType::kFloat32, {T, K});
  args.d_w_gate = cuda_view(b.d_w_gate, DType::kBFloat16, {E, I, H});
  args.d_w_up = cuda_view(b.d_w_up, DType::kBFloat16, {E, I, H});
  args.d_w_down = cuda_view(b.d_w_down, DType::kBFloat16, {E, H, I});
  args.d_w_shared_gate = cuda_view(b.d_w_shared_gate, DType::kBFloat16, {Is, H}, shared);
  args.d_w_shared_up = cuda_view(b.d_w_shared_up, DType::kBFloat16, {Is, H}, shared);
  args.d_w_shared_down = cuda_view(b.d_w_shared_down, DType::kBFloat16, {H, Is}, shared);
  return args;
}

void DeviceProblem::poison_outputs() {
  for (DeviceArray* output : buffers_->outputs)
    if (output->bytes > 0)
      check(cudaMemset(output->pointer, 0xFF, output->bytes), "poison outputs");
}

void DeviceProblem::download_outputs(HostRank& rank) const {
  const Buffers& b = *buffers_;
  b.out.download(rank.out, "out");
  b.d_x.download(rank.d_x, "d_x");
  b.d_router_weights.download(rank.d_router_weights, "d_router_weights");
  b.d_w_gate.download(rank.d_w_gate, "d_w_gate");
  b.d_w_up.download(rank.d_w_up, "d_w_up");
  b.d_w_down.download(rank.d_w_down, "d_w_down");
  b.d_w_shared_gate.download(rank.d_w_shared_gate, "d_w_shared_gate");
  b.d_w_shared_up.download(rank.d_w_shared_up, "d_w_shared_up");
  b.d_w_shared_down.download(rank.d_w_shared_down, "d_w_shared_down");
}

void DeviceProblem::upload_routing(const std::vector<int32_t>& top_experts) {
  if (top_experts.size() * sizeof(int32_t) != buffers_->top_experts.bytes)
    throw Error(ErrorCode::kInvalidArgument,
                "DeviceProblem::upload_routing: " + std::to_string(top_experts.size()) +
                    " entries; expected " +
                    std::to_string(buffers_->top_experts.bytes / sizeof(int32_t)));
  check(cudaMemcpy(buffers_->top_experts.pointer, top_experts.data(), buffers_->top_experts.bytes,
                   cudaMemcpyHostToDevice),
        "upload routing");
}

}  // namespace mok
