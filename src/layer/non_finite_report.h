// MoeConfig::check_finite on the host side: which inputs a layer call scans
// (kernels/non_finite_scan.h) and the message for the record the scan left.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/stages/non_finite_scan.h"
#include "mok/layer_args.h"
#include "mok/shape.h"

namespace mok {

// The forward's inputs: x, the routed slots' router weights, every weight.
kernels::NonFiniteScan forward_input_scan(const MoeShape& shape, const ForwardArgs& args);
// d_out, and with `with_forward_inputs` the forward's inputs too (a backward that recomputes
// reads them anew; one that starts from a forward's context reads what that forward scanned).
kernels::NonFiniteScan backward_input_scan(const MoeShape& shape, const BackwardArgs& args,
                                           bool with_forward_inputs);

// The message for a record (not kernels::kNoNonFinite) of rank `rank`, naming the tensor, the
// element by its coordinates (token and column, expert, row and column) and the value, e.g.
// "check_finite: x[token 5, column 17] = nan is not finite; ...".
std::string describe_non_finite(const MoeShape& shape, int32_t rank, unsigned long long record);

}  // namespace mok
