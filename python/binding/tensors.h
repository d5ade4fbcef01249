// Tensors from Python: any object that exports DLPack (a torch tensor's capsule, numpy) becomes a
// mok::TensorView over the same memory, without a copy; mok's own checks (check_forward_args and
// the rest) then validate dtype, shape, contiguity and device, naming the argument.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <optional>

#include "mok/tensor.h"

namespace mok::python {

using Array = nanobind::ndarray<>;

// The view of `array`; throws mok::Error(kInvalidArgument) naming `name` for a dtype mok has no
// name for, more than TensorView::kMaxDims dimensions, a 0-d array, or a device other than CPU
// and CUDA.
TensorView view_of(const Array& array, const char* name);

// An absent view for None (an optional tensor, e.g. the shared expert's weights).
TensorView view_of(const std::optional<Array>& array, const char* name);

}  // namespace mok::python
