// MoeConfig::check_finite on the host side: see non_finite_report.h.
#include "layer/non_finite_report.h"

#include <string>

namespace mok {

namespace {

using kernels::NonFiniteKind;
using kernels::ScannedTensor;

const char* tensor_name(ScannedTensor tensor);

// Adds `view` to the scan (nothing if it is absent or empty); returns its entry, or null.
kernels::ScanTensor* add(kernels::NonFiniteScan& scan, ScannedTensor id, const TensorView& view) {
  if (!view.present() || view.numel() == 0) return nullptr;
  if (!view.is_contiguous())
    throw Error(ErrorCode::kUnsupported,
                std::string("check_finite: `") + tensor_name(id) +
                    "` is a view with an expert stride; the scan reads contiguous tensors (pass a "
                    "contiguous one, or turn check_finite off)");
  kernels::ScanTensor& tensor = scan.tensors[scan.num_tensors++];
  tensor.data = view.data;
  tensor.count = view.numel();
  tensor.id = id;
  return &tensor;
}

void add_forward_inputs(kernels::NonFiniteScan& scan, const MoeShape& shape,
                        const ForwardArgs& args) {
  add(scan, ScannedTensor::kX, args.x);
  // Only the routed slots' weights: the layer never reads the others.
  if (kernels::ScanTensor* weights =
          add(scan, ScannedTensor::kRouterWeights, args.router_weights)) {
    weights->routes = args.top_experts.data;
    weights->routes_are_int64 = args.top_experts.dtype == DType::kInt64 ? 1 : 0;
    weights->num_experts = static_cast<int32_t>(shape.num_experts);
  }
  add(scan, ScannedTensor::kWGate, args.w_gate);
  add(scan, ScannedTensor::kWUp, args.w_up);
  add(scan, ScannedTensor::kWDown, args.w_down);
  if (shape.has_shared_expert()) {
    add(scan, ScannedTensor::kWSharedGate, args.w_shared_gate);
    add(scan, ScannedTensor::kWSharedUp, args.w_shared_up);
    add(scan, ScannedTensor::kWSharedDown, args.w_shared_down);
  }
}

const char* tensor_name(ScannedTensor tensor) {
  switch (tensor) {
    case ScannedTensor::kX:
      return "x";
    case ScannedTensor::kRouterWeights:
      return "router_weights";
    case ScannedTensor::kWGate:
      return "w_gate";
    case ScannedTensor::kWUp:
      return "w_up";
    case ScannedTensor::kWDown:
      return "w_down";
    case ScannedTensor::kWSharedGate:
      return "w_shared_gate";
    case ScannedTensor::kWSharedUp:
      return "w_shared_up";
    case ScannedTensor::kWSharedDown:
      return "w_shared_down";
    case ScannedTensor::kDOut:
      return "d_out";
    case ScannedTensor::kCount:
      break;
  }
  return "(unknown tensor)";
}

const char* kind_name(NonFiniteKind kind) {
  switch (kind) {
    case NonFiniteKind::kNaN:
      return "nan";
    case NonFiniteKind::kPositiveInf:
      return "+inf";
    case NonFiniteKind::kNegativeInf:
      return "-inf";
  }
  return "(unknown value)";
}

// "[token t, column c]", "[expert e, row r, column c]", ... for element `index` of `tensor`.
std::string coordinates(const MoeShape& shape, int32_t rank, ScannedTensor tensor, int64_t index) {
  const int64_t H = shape.hidden, I = shape.intermediate, Is = shape.shared_intermediate;
  auto at = [](const char* a, int64_t i, const char* b, int64_t j) {
    return std::string("[") + a + " " + std::to_string(i) + ", " + b + " " + std::to_string(j) +
           "]";
  };
  auto expert = [&](int64_t per_expert, int64_t columns) {
    const int64_t local = index / per_expert, within = index % per_expert;
    std::string name = "expert " + std::to_string(local);
    if (shape.num_ranks > 1)
      name = "local expert " + std::to_string(local) + " = expert " +
             std::to_string(rank * shape.num_local_experts() + local);
    return "[" + name + ", row " + std::to_string(within / columns) + ", column " +
           std::to_string(within % columns) + "]";
  };
  switch (tensor) {
    case ScannedTensor::kX:
    case ScannedTensor::kDOut:
      return at("token", index / H, "column", index % H);
    case ScannedTensor::kRouterWeights:
      return at("token", index / shape.top_k, "k", index % shape.top_k);
    case ScannedTensor::kWGate:
    case ScannedTensor::kWUp:
      return expert(I * H, H);
    case ScannedTensor::kWDown:
      return expert(H * I, I);
    case ScannedTensor::kWSharedGate:
    case ScannedTensor::kWSharedUp:
      return at("row", index / H, "column", index % H);
    case ScannedTensor::kWSharedDown:
      return at("row", index / Is, "column", index % Is);
    case ScannedTensor::kCount:
      break;
  }
  return "[element " + std::to_string(index) + "]";
}

}  // namespace

kernels::NonFiniteScan forward_input_scan(const MoeShape& shape, const ForwardArgs& args) {
  kernels::NonFiniteScan scan;
  add_forward_inputs(scan, shape, args);
  return scan;
}

kernels::NonFiniteScan backward_input_scan(const MoeShape& shape, const BackwardArgs& args,
                                           bool with_forward_inputs) {
  kernels::NonFiniteScan scan;
  if (with_forward_inputs) add_forward_inputs(scan, shape, args.forward);
  add(scan, ScannedTensor::kDOut, args.d_out);
  return scan;
}

std::string describe_non_finite(const MoeShape& shape, int32_t rank, unsigned long long record) {
  const ScannedTensor tensor = kernels::non_finite_tensor(record);
  return std::string("check_finite: ") + tensor_name(tensor) +
         coordinates(shape, rank, tensor, kernels::non_finite_index(record)) + " = " +
         kind_name(kernels::non_finite_kind(record)) +
         " is not finite (the first non-finite input of the calls since the last synchronize, in "
         "the order x, router_weights, w_gate, w_up, w_down, w_shared_gate, w_shared_up, "
         "w_shared_down, d_out)";
}

}  // namespace mok
