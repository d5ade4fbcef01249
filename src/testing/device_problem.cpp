// DeviceProblem: see include/mok/device_problem.h.
#include "mok/testing/device_problem.h"

#include <cuda_runtime_api.h>

#include <string>

#include "layer/cuda_buffer.h"

namespace mok {

namespace {

// A device copy of a host vector, and the way back.
template <typename T>
void upload(DeviceBuffer& buffer, const std::vector<T>& host, const char* what) {
  buffer.allocate(static_cast<int64_t>(host.size() * sizeof(T)),
                  std::string("DeviceProblem ") + what);
  if (buffer.bytes > 0)
    cuda_check(cudaMemcpy(buffer.pointer, host.data(), buffer.bytes, cudaMemcpyHostToDevice),
               std::string("DeviceProblem: upload ") + what);
}

template <typename T>
void download(const DeviceBuffer& buffer, std::vector<T>& host, const char* what) {
  if (static_cast<int64_t>(host.size() * sizeof(T)) != buffer.bytes)
    throw Error(ErrorCode::kInvalidArgument, std::string("DeviceProblem: host buffer for ") + what +
                                                 " has " + std::to_string(host.size() * sizeof(T)) +
                                                 " bytes; expected " +
                                                 std::to_string(buffer.bytes));
  if (buffer.bytes > 0)
    cuda_check(cudaMemcpy(host.data(), buffer.pointer, buffer.bytes, cudaMemcpyDeviceToHost),
               std::string("DeviceProblem: download ") + what);
}

}  // namespace

struct DeviceProblem::Buffers {
  DeviceBuffer x, d_out, top_experts, router_weights, w_gate, w_up, w_down, w_shared_gate,
      w_shared_up, w_shared_down;
  DeviceBuffer out, d_x, d_router_weights, d_w_gate, d_w_up, d_w_down, d_w_shared_gate,
      d_w_shared_up, d_w_shared_down;
  DeviceBuffer fp8_codes[HostFp8Weights::kCount], fp8_scales[HostFp8Weights::kCount];
  DeviceBuffer* outputs[9] = {&out,
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
  cuda_check(cudaGetDevice(&device_), "cudaGetDevice");
  if (rank < 0 || rank >= static_cast<int32_t>(problem.ranks.size()))
    throw Error(ErrorCode::kInvalidArgument, "DeviceProblem: rank = " + std::to_string(rank) +
                                                 "; valid: 0.." +
                                                 std::to_string(problem.ranks.size() - 1));
  const HostRank& host = problem.ranks[rank];
  Buffers& b = *buffers_;
  upload(b.x, host.x, "x");
  upload(b.d_out, host.d_out, "d_out");
  upload(b.top_experts, host.top_experts, "top_experts");
  upload(b.router_weights, host.router_weights, "router_weights");
  upload(b.w_gate, host.w_gate, "w_gate");
  upload(b.w_up, host.w_up, "w_up");
  upload(b.w_down, host.w_down, "w_down");
  upload(b.w_shared_gate, host.w_shared_gate, "w_shared_gate");
  upload(b.w_shared_up, host.w_shared_up, "w_shared_up");
  upload(b.w_shared_down, host.w_shared_down, "w_shared_down");
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
  ForwardArgs args = make_forward_args(shape_, pointers(), DeviceType::kCUDA, device_);
  if (fp8_weights_ != 0) {
    const void* codes[HostFp8Weights::kCount];
    const float* scales[HostFp8Weights::kCount];
    for (int i = 0; i < HostFp8Weights::kCount; ++i) {
      codes[i] = buffers_->fp8_codes[i].pointer;
      scales[i] = buffers_->fp8_scales[i].as<float>();
    }
    give_fp8_weights(shape_, args, codes, scales, fp8_weights_);
  }
  return args;
}

BackwardArgs DeviceProblem::backward_args() {
  BackwardArgs args = make_backward_args(shape_, pointers(), DeviceType::kCUDA, device_);
  args.forward = forward_args();
  args.forward.out = TensorView{};  // as make_backward_args leaves it
  return args;
}

void DeviceProblem::upload_fp8_weights(const HostFp8Weights& weights, unsigned which) {
  for (int i = 0; i < HostFp8Weights::kCount; ++i) {
    upload(buffers_->fp8_codes[i], weights.codes[i], "FP8 weight codes");
    upload(buffers_->fp8_scales[i], weights.scales[i], "FP8 weight scales");
  }
  fp8_weights_ = which;
}

void DeviceProblem::poison_outputs() {
  for (DeviceBuffer* output : buffers_->outputs)
    if (output->bytes > 0)
      cuda_check(cudaMemset(output->pointer, 0xFF, output->bytes), "poison outputs");
}

void DeviceProblem::download_outputs(HostRank& rank) const {
  const Buffers& b = *buffers_;
  download(b.out, rank.out, "out");
  download(b.d_x, rank.d_x, "d_x");
  download(b.d_router_weights, rank.d_router_weights, "d_router_weights");
  download(b.d_w_gate, rank.d_w_gate, "d_w_gate");
  download(b.d_w_up, rank.d_w_up, "d_w_up");
  download(b.d_w_down, rank.d_w_down, "d_w_down");
  download(b.d_w_shared_gate, rank.d_w_shared_gate, "d_w_shared_gate");
  download(b.d_w_shared_up, rank.d_w_shared_up, "d_w_shared_up");
  download(b.d_w_shared_down, rank.d_w_shared_down, "d_w_shared_down");
}

void DeviceProblem::upload_routing(const std::vector<int32_t>& top_experts) {
  if (static_cast<int64_t>(top_experts.size() * sizeof(int32_t)) != buffers_->top_experts.bytes)
    throw Error(ErrorCode::kInvalidArgument,
                "DeviceProblem::upload_routing: " + std::to_string(top_experts.size()) +
                    " entries; expected " +
                    std::to_string(buffers_->top_experts.bytes / sizeof(int32_t)));
  cuda_check(cudaMemcpy(buffers_->top_experts.pointer, top_experts.data(),
                        buffers_->top_experts.bytes, cudaMemcpyHostToDevice),
             "upload routing");
}

}  // namespace mok
