// The tensors of one MoE layer call on one rank, as views. The same structs serve the CPU
// reference and the GPU layer; `check_forward_args` / `check_backward_args` validate them.
//
// Shapes (T tokens on this rank, H hidden, I routed intermediate, Is shared intermediate,
// K top-k, E_loc experts owned by this rank):
#pragma once

#include <vector>

#include "mok/error.h"
#include "mok/shape.h"
#include "mok/tensor.h"

namespace mok {

struct ForwardArgs {
  TensorView x;               // [T, H] bf16
  TensorView top_experts;     // [T, K] int32 or int64; global expert id, -1 = no route
  TensorView router_weights;  // [T, K] fp32
  TensorView w_gate;          // [E_loc, I, H] bf16
  TensorView w_up;            // [E_loc, I, H] bf16
  TensorView w_down;          // [E_loc, H, I] bf16
  TensorView w_shared_gate;   // [Is, H] bf16, absent when Is = 0
  TensorView w_shared_up;     // [Is, H] bf16, absent when Is = 0
  TensorView w_shared_down;   // [H, Is] bf16, absent when Is = 0
  TensorView out;             // [T, H] bf16, written
  // MoeConfig::precision = kFP8Block: a nonzero value names the contents of the six weights.
  // The layer then keeps the weights it quantized in a call with the same value and weight
  // pointers, on the same stream, instead of quantizing them again. A caller changes it whenever
  // it changes the weights, e.g. once per optimizer step. 0 (the default) quantizes on every
  // call. bf16 ignores it.
  uint64_t weights_version = 0;
};

struct BackwardArgs {
  ForwardArgs forward;          // the forward's inputs (forward.out is not used)
  TensorView d_out;             // [T, H] bf16
  TensorView d_x;               // [T, H] bf16, written
  TensorView d_router_weights;  // [T, K] fp32, written (0 for slots with expert -1)
  TensorView d_w_gate;          // [E_loc, I, H] bf16, written
  TensorView d_w_up;            // [E_loc, I, H] bf16, written
  TensorView d_w_down;          // [E_loc, H, I] bf16, written
  TensorView d_w_shared_gate;   // [Is, H] bf16, written; absent when Is = 0
  TensorView d_w_shared_up;     // [Is, H] bf16, written; absent when Is = 0
  TensorView d_w_shared_down;   // [H, Is] bf16, written; absent when Is = 0
};

// Where one rank's tensors live, each row-major and contiguous with the shapes above (top_experts
// int32). The shared-expert pointers are ignored when the shape has no shared expert.
struct LayerPointers {
  void* x = nullptr;
  void* top_experts = nullptr;
  void* router_weights = nullptr;
  void* w_gate = nullptr;
  void* w_up = nullptr;
  void* w_down = nullptr;
  void* w_shared_gate = nullptr;
  void* w_shared_up = nullptr;
  void* w_shared_down = nullptr;
  void* out = nullptr;
  void* d_out = nullptr;
  void* d_x = nullptr;
  void* d_router_weights = nullptr;
  void* d_w_gate = nullptr;
  void* d_w_up = nullptr;
  void* d_w_down = nullptr;
  void* d_w_shared_gate = nullptr;
  void* d_w_shared_up = nullptr;
  void* d_w_shared_down = nullptr;
};

// The views of a forward / backward call over `pointers` (backward: forward.out absent).
ForwardArgs make_forward_args(const MoeShape& shape, const LayerPointers& pointers,
                              DeviceType device_type, int32_t device_id = 0);
BackwardArgs make_backward_args(const MoeShape& shape, const LayerPointers& pointers,
                                DeviceType device_type, int32_t device_id = 0);

// A tensor of a call with its argument name, for checks and messages.
struct NamedTensor {
  const char* name;
  const TensorView* view;
};
// The nine inputs of a call (x, top_experts, router_weights, the six weights), in that order.
std::vector<NamedTensor> named_inputs(const ForwardArgs& args);
// The eight outputs of a backward call (d_x, d_router_weights, the six weight gradients).
std::vector<NamedTensor> named_outputs(const BackwardArgs& args);
// True when both views are present, non-empty, and their byte ranges intersect.
bool tensors_overlap(const TensorView& a, const TensorView& b);

// Validates dtypes, shapes, contiguity, devices, and that no output overlaps an input or
// another output. `device_type` is where every tensor must live. For CUDA tensors the data
// pointers must also be 16-byte aligned (TMA). Expert ids are data: see check_top_experts.
Status check_forward_args(const MoeShape& shape, const ForwardArgs& args, DeviceType device_type);
Status check_backward_args(const MoeShape& shape, const BackwardArgs& args, DeviceType device_type);

// Host-side check of expert id values (CPU tensors only): every entry in [-1, E). The message
// names the first bad entry by rank, token and slot.
Status check_top_experts(const MoeShape& shape, const TensorView& top_experts, int32_t rank);

// Reads entry `index` of an int32 or int64 tensor as int64.
int64_t read_expert_id(const TensorView& top_experts, int64_t index);

}  // namespace mok
