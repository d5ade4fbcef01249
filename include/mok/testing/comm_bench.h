// The expert-parallel data movement alone, timed on the GPUs of this machine (`mok comm-bench`):
// pull and push dispatch, push combine, their contiguous-copy ceilings, NCCL's all-to-all of the
// same rows, and the routing exchange with the schedule build. It calls the communication
// kernels directly, so it lives with the fixtures rather than in the CLI.
#pragma once

#include <cstdint>

#include "mok/shape.h"
#include "mok/testing/routing.h"

namespace mok {

// Runs the benchmark on GPUs 0 .. shape.num_ranks - 1 with the routing `routing` (seeded by
// `seed`), prints its table to stdout and returns 0. Throws mok::Error when a variant leaves
// other bytes than the pull or the GPU builder another schedule than the host (kInternal), and
// in a build without NCCL (kUnsupported).
int run_comm_bench(const MoeShape& shape, RoutingKind routing, uint64_t seed);

}  // namespace mok
