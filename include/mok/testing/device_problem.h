// DeviceProblem: one rank of a HostProblem copied to a GPU, with device output buffers; the
// GPU tests and the CLI use it to run the GPU layer on the same inputs as the CPU reference.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "mok/layer_args.h"
#include "mok/testing/host_problem.h"

namespace mok {

// A bf16 output element that DeviceProblem::poison_outputs filled and nothing wrote since (not
// HostProblem's kPoisonBf16Bits: the device poison is a byte memset).
inline constexpr uint16_t kDevicePoisonBf16Bits = 0xFFFF;

class DeviceProblem {
 public:
  // Copies rank `rank` of `problem` to the current CUDA device (inputs; outputs allocated).
  DeviceProblem(const HostProblem& problem, int32_t rank);
  ~DeviceProblem();
  DeviceProblem(const DeviceProblem&) = delete;
  DeviceProblem& operator=(const DeviceProblem&) = delete;

  ForwardArgs forward_args();
  BackwardArgs backward_args();
  // Fills every output with 0xFF bytes (bf16 and fp32 NaN: kDevicePoisonBf16Bits), so unwritten
  // elements show up.
  void poison_outputs();
  // Copies the outputs into `rank`'s output vectors (which must have the right sizes).
  void download_outputs(HostRank& rank) const;
  // Copies new routing (same shape) to the device.
  void upload_routing(const std::vector<int32_t>& top_experts);
  // Copies `weights` to the device: from then on forward_args() and backward_args() give the
  // weights whose bit is set in `which` pre-quantized (give_fp8_weights), the others as bf16.
  void upload_fp8_weights(const HostFp8Weights& weights, unsigned which = 0x3f);

 private:
  struct Buffers;
  LayerPointers pointers() const;
  MoeShape shape_;
  int device_ = 0;
  unsigned fp8_weights_ = 0;  // upload_fp8_weights's `which`
  std::unique_ptr<Buffers> buffers_;
};

}  // namespace mok
