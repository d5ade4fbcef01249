// The tensors of one MoE layer call on one rank, as views. The same structs serve the CPU
// reference and the GPU layer; `check_forward_args` / `check_backward_args` validate them.
//
// Shapes (T tokens on this rank, H hidden, I routed intermediate, Is shared intermediate,
// K top-k, E_loc experts owned by this rank):
#pragma once

#include <vector>

#include "mok/config.h"
#include "mok/error.h"
#include "mok/shape.h"
#include "mok/tensor.h"

namespace mok {

// A weight given already in FP8 (MoeConfig::precision = kFP8Block), in the layout mok
// quantizes bf16 weights into (mok/fp8.h's quantize_fp8_blocks, expert by expert): `codes`
// e4m3 (DType::kFloat8E4M3) with the bf16 weight's shape, [E_loc, n, k] or [n, k] for the
// shared expert, and `scales` fp32 with one value per 128 x 128 block, [E_loc, n/128, k/128] or
// [n/128, k/128]; value ~ e4m3_to_float(codes[.., r, c]) * scales[.., r/128, c/128]. n and k
// multiples of 128; the scales contiguous, and the codes too, except that a routed expert
// weight's codes may be an expert-strided view (TensorView::is_outer_strided: the gate or up
// half of a fused [E_loc, 2I, H] checkpoint tensor, as Hugging Face's FP8 models store them).
struct Fp8BlockWeight {
  TensorView codes;
  TensorView scales;
  bool present() const { return codes.present() || scales.present(); }
};

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
  // forward. A forward that keeps its context quantizes the dgrads' transposed copies too, and the
  // backward that follows uses them whatever the version: the weights must not change in place
  // between a forward and its backward (as autograd requires). bf16 ignores it.
  uint64_t weights_version = 0;
  // Pre-quantized weights (precision fp8_block only). A matrix given here leaves its bf16 view
  // above absent: the layer reads these codes and scales as they are and never quantizes that
  // matrix. The backward's transposed copies are the same codes and scales transposed
  // (bit-identical to quantizing the transposed bf16 weight: a block's amax is the same both
  // ways). The weight gradients are still written in bf16 into the d_w_* tensors.
  Fp8BlockWeight w_gate_fp8;         // [E_loc, I, H]
  Fp8BlockWeight w_up_fp8;           // [E_loc, I, H]
  Fp8BlockWeight w_down_fp8;         // [E_loc, H, I]
  Fp8BlockWeight w_shared_gate_fp8;  // [Is, H]
  Fp8BlockWeight w_shared_up_fp8;    // [Is, H]
  Fp8BlockWeight w_shared_down_fp8;  // [H, Is]
  // False: no backward starts from this forward (an evaluation, a forward under torch.no_grad).
  // The layer then skips what only a backward reads: the gate/up GEMM's bf16 g and u beside h
  // (the standalone and persistent forward kernels; the 256 x 192 tiles still write them), and
  // in FP8 the x rows' column groups. The outputs are the same bits. The context it returns is
  // one no backward accepts, and it makes the older ones stale: a backward recomputes.
  bool keep_context = true;
};

// True when any weight of `args` is given pre-quantized.
bool has_fp8_weights(const ForwardArgs& args);
// Ok unless `args` gives pre-quantized weights to a layer whose precision is not fp8_block
// (`call` names the call in the message).
Status check_weight_precision(const char* call, const ForwardArgs& args, Precision precision);

// The weight gradients are all given or all absent. Absent (frozen experts: a fine-tune that
// trains the router, the attention or adapters only), the backward computes d_x and
// d_router_weights alone and skips the weight-gradient GEMMs, the largest stage of a backward.
// Precision fp8_block also takes them in fp32 (each on its own: fp32 main gradients) and
// `accumulate_weight_grads`: the gradients are added to what the d_w_* tensors hold, d_w =
// round(d_w + this call's gradient) per element with one fp32 add (a micro-batch's gradient into
// the main gradient, in call order: the same bits every run). The bf16 layer writes bf16.
struct BackwardArgs {
  ForwardArgs forward;          // the forward's inputs (forward.out is not used)
  TensorView d_out;             // [T, H] bf16
  TensorView d_x;               // [T, H] bf16, written
  TensorView d_router_weights;  // [T, K] fp32, written (0 for slots with expert -1)
  TensorView d_w_gate;          // [E_loc, I, H] bf16 (fp8_block: or fp32), written or added to
  TensorView d_w_up;            // [E_loc, I, H] likewise
  TensorView d_w_down;          // [E_loc, H, I] likewise
  TensorView d_w_shared_gate;   // [Is, H] likewise; absent when Is = 0
  TensorView d_w_shared_up;     // [Is, H] likewise; absent when Is = 0
  TensorView d_w_shared_down;   // [H, Is] likewise; absent when Is = 0
  bool accumulate_weight_grads = false;  // fp8_block: add to d_w_* instead of writing them
};

// Whether a backward call asks for the weight gradients (check_backward_args checks that they
// are all given or all absent).
inline bool wants_weight_gradients(const BackwardArgs& args) { return args.d_w_gate.present(); }

// The same call with frozen weights: every weight gradient absent.
inline BackwardArgs without_weight_gradients(BackwardArgs args) {
  for (TensorView* grad : {&args.d_w_gate, &args.d_w_up, &args.d_w_down, &args.d_w_shared_gate,
                           &args.d_w_shared_up, &args.d_w_shared_down})
    *grad = TensorView{};
  return args;
}

// check_weight_precision of the forward's weights, and Ok unless a weight gradient is fp32 or
// accumulate_weight_grads is set for a layer whose precision is not fp8_block.
Status check_backward_precision(const char* call, const BackwardArgs& args, Precision precision);

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
// The inputs of a call: x, top_experts, router_weights, the six weights, then the codes and
// scales of the pre-quantized weights (absent views where none are given), in that order.
std::vector<NamedTensor> named_inputs(const ForwardArgs& args);
// The eight outputs of a backward call (d_x, d_router_weights, the six weight gradients).
std::vector<NamedTensor> named_outputs(const BackwardArgs& args);
// The six weight gradients of a backward call, d_w_gate to d_w_shared_down.
std::vector<NamedTensor> named_weight_gradients(const BackwardArgs& args);
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
