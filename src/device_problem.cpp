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
  check(cudaGetDevice(&device_), "cudaGetDevice");
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

LayerPointers DeviceProblem::pointers() const {
  const Buffers& b = *buffers_;
  LayerPointers p;
  p.x = b.x.pointer;
  p.top_experts = b.top_experts.pointer;
  p.router_weights = b.router_weights.pointer;
  p.w_gate = b.w_gate.pointer;
  p.w_up = b.w_up.pointer;
  p.w_down = b.w_down.pointer;
  p.w_shared_gate = b.w_shared_gate.pointer;
  p.w_shared_up = b.w_shared_up.pointer;
  p.w_shared_down = b.w_shared_down.pointer;
  p.out = b.out.pointer;
  p.d_out = b.d_out.pointer;
  p.d_x = b.d_x.pointer;
  p.d_router_weights = b.d_router_weights.pointer;
  p.d_w_gate = b.d_w_gate.pointer;
  p.d_w_up = b.d_w_up.pointer;
  p.d_w_down = b.d_w_down.pointer;
  p.d_w_shared_gate = b.d_w_shared_gate.pointer;
  p.d_w_shared_up = b.d_w_shared_up.pointer;
  p.d_w_shared_down = b.d_w_shared_down.pointer;
  return p;
}

ForwardArgs DeviceProblem::forward_args() {
  return make_forward_args(shape_, pointers(), DeviceType::kCUDA, device_);
}

BackwardArgs DeviceProblem::backward_args() {
  return make_backward_args(shape_, pointers(), DeviceType::kCUDA, device_);
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
