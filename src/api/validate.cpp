// Validation of the tensors of a layer call (include/mok/layer_args.h). Runs on the host before
// anything is launched or written; every message names the argument, what it was, and what
// would be valid.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "api/messages.h"
#include "mok/layer_args.h"

namespace mok {

namespace {

struct Dim {
  const char* label;  // e.g. "E_loc"
  int64_t extent;
};

std::string expected_text(const std::vector<Dim>& dims, DType dtype) {
  std::string text = "[";
  for (size_t d = 0; d < dims.size(); ++d) {
    if (d > 0) text += ", ";
    text += std::string(dims[d].label) + "=" + std::to_string(dims[d].extent);
  }
  return text + "] " + dtype_name(dtype);
}

// Context shared by the checks of one call: where tensors must live, and the device they share.
struct CallChecker {
  const char* call;  // "forward" or "backward"
  DeviceType device_type;
  int32_t device_id = -1;

  Status fail(const std::string& name, const std::string& what) const {
    return Status::invalid(std::string(call) + ": argument `" + name + "` " + what);
  }

  // `allowed_dtypes` lists what is accepted; the first one is named in the message.
  // `outer_strided`: an expert-strided view is accepted (is_outer_strided), its expert stride a
  // multiple of 16 bytes (the routed experts' weights and their gradients, read and written by
  // TMA over one map per tensor).
  Status check(const std::string& name, const TensorView& view, std::vector<DType> allowed_dtypes,
               const std::vector<Dim>& dims, bool outer_strided = false) {
    const std::string expected = expected_text(dims, allowed_dtypes.front());
    if (!view.present()) return fail(name, "is missing; expected " + expected);
    if (view.device_type != device_type)
      return fail(name, std::string("is on ") + device_type_name(view.device_type) +
                            "; expected a " + device_type_name(device_type) + " tensor");
    if (device_type == DeviceType::kCUDA) {
      if (device_id < 0) device_id = view.device_id;
      if (view.device_id != device_id)
        return fail(name,
                    "is on cuda:" + std::to_string(view.device_id) +
                        "; every tensor of the call must be on cuda:" + std::to_string(device_id));
    }
    bool dtype_ok = false;
    for (DType allowed : allowed_dtypes) dtype_ok |= view.dtype == allowed;
    if (!dtype_ok) {
      std::string valid;
      for (DType allowed : allowed_dtypes)
        valid += std::string(valid.empty() ? "" : " or ") + dtype_name(allowed);
      return fail(name, std::string("has dtype ") + dtype_name(view.dtype) + "; expected " + valid);
    }
    bool shape_ok = view.ndim == static_cast<int32_t>(dims.size());
    for (size_t d = 0; shape_ok && d < dims.size(); ++d) shape_ok = view.shape[d] == dims[d].extent;
    if (!shape_ok) return fail(name, "has shape " + view.shape_string() + "; expected " + expected);
    std::string strides = "[";
    for (int d = 0; d < view.ndim; ++d)
      strides += (d ? ", " : "") + std::to_string(view.strides[d]);
    strides += "]";
    if (outer_strided) {
      if (!view.is_outer_strided())
        return fail(name, "is not row-major within each expert (strides " + strides +
                              "); pass a tensor whose experts are dense [rows, columns] matrices "
                              "(the expert stride may be larger)");
      if (view.outer_stride() * dtype_size(view.dtype) % 16 != 0)
        return fail(name, "has an expert stride of " + std::to_string(view.outer_stride()) +
                              " elements; expected a multiple of 16 bytes (TMA)");
    } else if (!view.is_contiguous()) {
      return fail(
          name, "is not contiguous (strides " + strides + "); pass a row-major contiguous tensor");
    }
    if (view.numel() > 0 && view.data == nullptr) return fail(name, "has a null data pointer");
    if (device_type == DeviceType::kCUDA && reinterpret_cast<uintptr_t>(view.data) % 16 != 0)
      return fail(name, "data pointer is not 16-byte aligned (the GPU's bulk copies need it)");
    return Status::Ok();
  }

  Status check_absent(const std::string& name, const TensorView& view) const {
    if (view.present())
      return fail(name, "was given (shape " + view.shape_string() +
                            ") but the shape has no shared expert (shared_intermediate = 0)");
    return Status::Ok();
  }
};

// Every output must be disjoint from every input and from the other outputs.
Status check_no_overlap(const char* call, const std::vector<NamedTensor>& inputs,
                        const std::vector<NamedTensor>& outputs) {
  for (size_t o = 0; o < outputs.size(); ++o) {
    for (const auto& input : inputs)
      if (tensors_overlap(*outputs[o].view, *input.view))
        return Status::invalid(std::string(call) + ": output `" + outputs[o].name +
                               "` overlaps input `" + input.name +
                               "`; outputs need their own memory");
    for (size_t other = o + 1; other < outputs.size(); ++other)
      if (tensors_overlap(*outputs[o].view, *outputs[other].view))
        return Status::invalid(std::string(call) + ": outputs `" + outputs[o].name + "` and `" +
                               outputs[other].name + "` overlap; each output needs its own memory");
  }
  return Status::Ok();
}

// A weight given in one of its two forms: bf16 (`name`) or pre-quantized (`name`_fp8, codes
// with the weight's dims and one scale per 128 x 128 block of its last two). `outer_strided`
// (the routed experts): the bf16 weight or the codes may be expert-strided views (the halves of
// a fused [E, 2I, H] gate/up weight); the scales are contiguous.
Status check_weight(CallChecker& checker, const std::string& name, const TensorView& weight,
                    const Fp8BlockWeight& fp8, const std::vector<Dim>& dims, bool outer_strided) {
  if (!fp8.present()) return checker.check(name, weight, {DType::kBFloat16}, dims, outer_strided);
  const std::string fp8_name = name + "_fp8";
  if (weight.present())
    return checker.fail(name, "was given together with `" + fp8_name +
                                  "`; pass the weight either as bf16 or pre-quantized");
  std::vector<Dim> scale_dims = dims;
  static const char* kBlockLabels[] = {"n/128", "k/128"};
  for (size_t d = dims.size() - 2; d < dims.size(); ++d) {
    if (dims[d].extent % 128 != 0)
      return checker.fail(fp8_name, std::string("needs ") + dims[d].label + " = " +
                                        std::to_string(dims[d].extent) +
                                        " to be a multiple of 128 (the FP8 weight blocks)");
    scale_dims[d] = {kBlockLabels[d + 2 - dims.size()], dims[d].extent / 128};
  }
  MOK_RETURN_IF_ERROR(
      checker.check(fp8_name + ".codes", fp8.codes, {DType::kFloat8E4M3}, dims, outer_strided));
  return checker.check(fp8_name + ".scales", fp8.scales, {DType::kFloat32}, scale_dims);
}

Status check_inputs(CallChecker& checker, const MoeShape& shape, const ForwardArgs& args) {
  const Dim T{"T", shape.num_tokens}, H{"H", shape.hidden}, I{"I", shape.intermediate},
      K{"K", shape.top_k}, E{"E_loc", shape.num_local_experts()},
      Is{"Is", shape.shared_intermediate};
  MOK_RETURN_IF_ERROR(checker.check("x", args.x, {DType::kBFloat16}, {T, H}));
  MOK_RETURN_IF_ERROR(
      checker.check("top_experts", args.top_experts, {DType::kInt32, DType::kInt64}, {T, K}));
  MOK_RETURN_IF_ERROR(
      checker.check("router_weights", args.router_weights, {DType::kFloat32}, {T, K}));
  MOK_RETURN_IF_ERROR(
      check_weight(checker, "w_gate", args.w_gate, args.w_gate_fp8, {E, I, H}, true));
  MOK_RETURN_IF_ERROR(check_weight(checker, "w_up", args.w_up, args.w_up_fp8, {E, I, H}, true));
  MOK_RETURN_IF_ERROR(
      check_weight(checker, "w_down", args.w_down, args.w_down_fp8, {E, H, I}, true));
  if (shape.has_shared_expert()) {
    MOK_RETURN_IF_ERROR(check_weight(checker, "w_shared_gate", args.w_shared_gate,
                                     args.w_shared_gate_fp8, {Is, H}, false));
    MOK_RETURN_IF_ERROR(check_weight(checker, "w_shared_up", args.w_shared_up, args.w_shared_up_fp8,
                                     {Is, H}, false));
    MOK_RETURN_IF_ERROR(check_weight(checker, "w_shared_down", args.w_shared_down,
                                     args.w_shared_down_fp8, {H, Is}, false));
  } else {
    MOK_RETURN_IF_ERROR(checker.check_absent("w_shared_gate", args.w_shared_gate));
    MOK_RETURN_IF_ERROR(checker.check_absent("w_shared_up", args.w_shared_up));
    MOK_RETURN_IF_ERROR(checker.check_absent("w_shared_down", args.w_shared_down));
    for (const auto& [name, fp8] : {std::pair<const char*, const Fp8BlockWeight*>{
                                        "w_shared_gate_fp8", &args.w_shared_gate_fp8},
                                    {"w_shared_up_fp8", &args.w_shared_up_fp8},
                                    {"w_shared_down_fp8", &args.w_shared_down_fp8}}) {
      MOK_RETURN_IF_ERROR(checker.check_absent(std::string(name) + ".codes", fp8->codes));
      MOK_RETURN_IF_ERROR(checker.check_absent(std::string(name) + ".scales", fp8->scales));
    }
  }
  return Status::Ok();
}

}  // namespace

Status check_forward_args(const MoeShape& shape, const ForwardArgs& args, DeviceType device_type) {
  MOK_RETURN_IF_ERROR(can_implement(shape));
  CallChecker checker{"forward", device_type};
  MOK_RETURN_IF_ERROR(check_inputs(checker, shape, args));
  MOK_RETURN_IF_ERROR(checker.check("out", args.out, {DType::kBFloat16},
                                    {{"T", shape.num_tokens}, {"H", shape.hidden}}));
  return check_no_overlap("forward", named_inputs(args), {{"out", &args.out}});
}

Status check_backward_args(const MoeShape& shape, const BackwardArgs& args,
                           DeviceType device_type) {
  MOK_RETURN_IF_ERROR(can_implement(shape));
  CallChecker checker{"backward", device_type};
  MOK_RETURN_IF_ERROR(check_inputs(checker, shape, args.forward));
  const Dim T{"T", shape.num_tokens}, H{"H", shape.hidden}, I{"I", shape.intermediate},
      K{"K", shape.top_k}, E{"E_loc", shape.num_local_experts()},
      Is{"Is", shape.shared_intermediate};
  MOK_RETURN_IF_ERROR(checker.check("d_out", args.d_out, {DType::kBFloat16}, {T, H}));
  MOK_RETURN_IF_ERROR(checker.check("d_x", args.d_x, {DType::kBFloat16}, {T, H}));
  MOK_RETURN_IF_ERROR(
      checker.check("d_router_weights", args.d_router_weights, {DType::kFloat32}, {T, K}));
  if (!wants_weight_gradients(args)) {
    if (args.accumulate_weight_grads)
      return checker.fail("accumulate_weight_grads",
                          "is set but the weight gradients are absent (frozen weights); pass "
                          "d_w_* to accumulate into, or leave it false");
    // Frozen weights: every weight gradient absent (one given alone names the mix).
    for (const NamedTensor& grad : named_weight_gradients(args))
      if (grad.view->present())
        return checker.fail(grad.name,
                            "was given without d_w_gate; the weight gradients are all "
                            "given, or all absent (frozen weights)");
  } else {
    // bf16, or fp32 (precision fp8_block: check_backward_precision).
    const std::vector<DType> grad_dtypes{DType::kBFloat16, DType::kFloat32};
    MOK_RETURN_IF_ERROR(checker.check("d_w_gate", args.d_w_gate, grad_dtypes, {E, I, H}, true));
    MOK_RETURN_IF_ERROR(checker.check("d_w_up", args.d_w_up, grad_dtypes, {E, I, H}, true));
    MOK_RETURN_IF_ERROR(checker.check("d_w_down", args.d_w_down, grad_dtypes, {E, H, I}, true));
    if (shape.has_shared_expert()) {
      MOK_RETURN_IF_ERROR(
          checker.check("d_w_shared_gate", args.d_w_shared_gate, grad_dtypes, {Is, H}));
      MOK_RETURN_IF_ERROR(checker.check("d_w_shared_up", args.d_w_shared_up, grad_dtypes, {Is, H}));
      MOK_RETURN_IF_ERROR(
          checker.check("d_w_shared_down", args.d_w_shared_down, grad_dtypes, {H, Is}));
    } else {
      MOK_RETURN_IF_ERROR(checker.check_absent("d_w_shared_gate", args.d_w_shared_gate));
      MOK_RETURN_IF_ERROR(checker.check_absent("d_w_shared_up", args.d_w_shared_up));
      MOK_RETURN_IF_ERROR(checker.check_absent("d_w_shared_down", args.d_w_shared_down));
    }
  }
  std::vector<NamedTensor> inputs = named_inputs(args.forward);
  inputs.push_back({"d_out", &args.d_out});
  return check_no_overlap("backward", inputs, named_outputs(args));
}

ForwardArgs make_forward_args(const MoeShape& shape, const LayerPointers& p, DeviceType device_type,
                              int32_t device_id) {
  const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate, K = shape.top_k,
                E = shape.num_local_experts(), Is = shape.shared_intermediate;
  auto view = [&](void* data, DType dtype, std::initializer_list<int64_t> dims) {
    return TensorView::contiguous(data, dtype, dims, device_type, device_id);
  };
  ForwardArgs args;
  args.x = view(p.x, DType::kBFloat16, {T, H});
  args.top_experts = view(p.top_experts, DType::kInt32, {T, K});
  args.router_weights = view(p.router_weights, DType::kFloat32, {T, K});
  args.w_gate = view(p.w_gate, DType::kBFloat16, {E, I, H});
  args.w_up = view(p.w_up, DType::kBFloat16, {E, I, H});
  args.w_down = view(p.w_down, DType::kBFloat16, {E, H, I});
  if (shape.has_shared_expert()) {
    args.w_shared_gate = view(p.w_shared_gate, DType::kBFloat16, {Is, H});
    args.w_shared_up = view(p.w_shared_up, DType::kBFloat16, {Is, H});
    args.w_shared_down = view(p.w_shared_down, DType::kBFloat16, {H, Is});
  }
  args.out = view(p.out, DType::kBFloat16, {T, H});
  return args;
}

BackwardArgs make_backward_args(const MoeShape& shape, const LayerPointers& p,
                                DeviceType device_type, int32_t device_id) {
  const int64_t T = shape.num_tokens, H = shape.hidden, I = shape.intermediate, K = shape.top_k,
                E = shape.num_local_experts(), Is = shape.shared_intermediate;
  auto view = [&](void* data, DType dtype, std::initializer_list<int64_t> dims) {
    return TensorView::contiguous(data, dtype, dims, device_type, device_id);
  };
  BackwardArgs args;
  args.forward = make_forward_args(shape, p, device_type, device_id);
  args.forward.out = TensorView{};
  args.d_out = view(p.d_out, DType::kBFloat16, {T, H});
  args.d_x = view(p.d_x, DType::kBFloat16, {T, H});
  args.d_router_weights = view(p.d_router_weights, DType::kFloat32, {T, K});
  args.d_w_gate = view(p.d_w_gate, DType::kBFloat16, {E, I, H});
  args.d_w_up = view(p.d_w_up, DType::kBFloat16, {E, I, H});
  args.d_w_down = view(p.d_w_down, DType::kBFloat16, {E, H, I});
  if (shape.has_shared_expert()) {
    args.d_w_shared_gate = view(p.d_w_shared_gate, DType::kBFloat16, {Is, H});
    args.d_w_shared_up = view(p.d_w_shared_up, DType::kBFloat16, {Is, H});
    args.d_w_shared_down = view(p.d_w_shared_down, DType::kBFloat16, {H, Is});
  }
  return args;
}

std::vector<NamedTensor> named_inputs(const ForwardArgs& args) {
  return {{"x", &args.x},
          {"top_experts", &args.top_experts},
          {"router_weights", &args.router_weights},
          {"w_gate", &args.w_gate},
          {"w_up", &args.w_up},
          {"w_down", &args.w_down},
          {"w_shared_gate", &args.w_shared_gate},
          {"w_shared_up", &args.w_shared_up},
          {"w_shared_down", &args.w_shared_down},
          {"w_gate_fp8.codes", &args.w_gate_fp8.codes},
          {"w_gate_fp8.scales", &args.w_gate_fp8.scales},
          {"w_up_fp8.codes", &args.w_up_fp8.codes},
          {"w_up_fp8.scales", &args.w_up_fp8.scales},
          {"w_down_fp8.codes", &args.w_down_fp8.codes},
          {"w_down_fp8.scales", &args.w_down_fp8.scales},
          {"w_shared_gate_fp8.codes", &args.w_shared_gate_fp8.codes},
          {"w_shared_gate_fp8.scales", &args.w_shared_gate_fp8.scales},
          {"w_shared_up_fp8.codes", &args.w_shared_up_fp8.codes},
          {"w_shared_up_fp8.scales", &args.w_shared_up_fp8.scales},
          {"w_shared_down_fp8.codes", &args.w_shared_down_fp8.codes},
          {"w_shared_down_fp8.scales", &args.w_shared_down_fp8.scales}};
}

Status check_weight_precision(const char* call, const ForwardArgs& args, Precision precision) {
  if (precision == Precision::kFP8Block || !has_fp8_weights(args)) return Status::Ok();
  return Status::invalid(std::string(call) + ": pre-quantized FP8 weights (w_*_fp8) were given " +
                         "but the precision is " + precision_name(precision) +
                         "; pass bf16 weights, or use precision fp8_block");
}

Status check_backward_precision(const char* call, const BackwardArgs& args, Precision precision) {
  MOK_RETURN_IF_ERROR(check_weight_precision(call, args.forward, precision));
  if (precision == Precision::kFP8Block) return Status::Ok();
  const std::string layer = std::string("; the ") + precision_name(precision) + " layer ";
  if (args.accumulate_weight_grads)
    return Status::invalid(std::string(call) + ": accumulate_weight_grads is set" + layer +
                           "writes its weight gradients; leave it false, or use precision "
                           "fp8_block");
  for (const NamedTensor& grad : named_weight_gradients(args))
    if (grad.view->present() && grad.view->dtype == DType::kFloat32)
      return Status::invalid(std::string(call) + ": " + grad.name + " is fp32" + layer +
                             "writes bf16 weight gradients; pass bf16, or use precision "
                             "fp8_block");
  return Status::Ok();
}

bool has_fp8_weights(const ForwardArgs& args) {
  for (const Fp8BlockWeight* fp8 :
       {&args.w_gate_fp8, &args.w_up_fp8, &args.w_down_fp8, &args.w_shared_gate_fp8,
        &args.w_shared_up_fp8, &args.w_shared_down_fp8})
    if (fp8->present()) return true;
  return false;
}

std::vector<NamedTensor> named_weight_gradients(const BackwardArgs& args) {
  return {{"d_w_gate", &args.d_w_gate},           {"d_w_up", &args.d_w_up},
          {"d_w_down", &args.d_w_down},           {"d_w_shared_gate", &args.d_w_shared_gate},
          {"d_w_shared_up", &args.d_w_shared_up}, {"d_w_shared_down", &args.d_w_shared_down}};
}

std::vector<NamedTensor> named_outputs(const BackwardArgs& args) {
  std::vector<NamedTensor> outputs = {{"d_x", &args.d_x},
                                      {"d_router_weights", &args.d_router_weights}};
  for (const NamedTensor& grad : named_weight_gradients(args)) outputs.push_back(grad);
  return outputs;
}

namespace {

// A view's memory as `count` blocks of `bytes` bytes, `stride` bytes apart: one block for a
// contiguous tensor, one per expert for an outer-strided one; any other layout is covered by
// the one block from its first to past its last element.
struct Blocks {
  uintptr_t begin;
  int64_t bytes, stride, count;
};

Blocks blocks_of(const TensorView& view) {
  const int64_t element = dtype_size(view.dtype);
  const auto begin = reinterpret_cast<uintptr_t>(view.data);
  if (view.is_contiguous()) return {begin, view.nbytes(), 0, 1};
  if (view.is_outer_strided())
    return {begin, view.numel() / view.shape[0] * element, view.outer_stride() * element,
            view.shape[0]};
  int64_t last = 0;  // the offset of the last element (strides are non-negative here)
  for (int d = 0; d < view.ndim; ++d) last += (view.shape[d] - 1) * view.strides[d];
  return {begin, (last + 1) * element, 0, 1};
}

}  // namespace

bool tensors_overlap(const TensorView& a, const TensorView& b) {
  if (!a.present() || !b.present() || a.nbytes() == 0 || b.nbytes() == 0) return false;
  const Blocks x = blocks_of(a), y = blocks_of(b);
  // Both block lists are sorted and each is disjoint within itself: one merge walk.
  for (int64_t i = 0, j = 0; i < x.count && j < y.count;) {
    const uintptr_t x_begin = x.begin + i * x.stride, x_end = x_begin + x.bytes;
    const uintptr_t y_begin = y.begin + j * y.stride, y_end = y_begin + y.bytes;
    if (x_begin < y_end && y_begin < x_end) return true;
    if (x_end <= y_end)
      ++i;
    else
      ++j;
  }
  return false;
}

int64_t read_expert_id(const TensorView& top_experts, int64_t index) {
  if (top_experts.dtype == DType::kInt64) return top_experts.data_as<const int64_t>()[index];
  return top_experts.data_as<const int32_t>()[index];
}

Status check_top_experts(const MoeShape& shape, const TensorView& top_experts, int32_t rank) {
  if (top_experts.device_type != DeviceType::kCPU)
    return Status::invalid("check_top_experts: reads values on the host; `top_experts` is on " +
                           std::string(device_type_name(top_experts.device_type)) +
                           " (the GPU layer reports bad ids through its error word instead)");
  const int64_t count = top_experts.numel();
  for (int64_t index = 0; index < count; ++index) {
    const int64_t expert = read_expert_id(top_experts, index);
    if (expert < -1 || expert >= shape.num_experts)
      return Status::invalid(bad_expert_id_message(rank, index / shape.top_k, index % shape.top_k,
                                                   expert, shape.num_experts));
  }
  return Status::Ok();
}

}  // namespace mok
