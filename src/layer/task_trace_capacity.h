// How many events a persistent kernel's task trace needs (MoeConfig::trace_tasks): events are
// indexed by ticket, so a launch needs one per ticket it can take, which the task orders count
// (kernels/persistent/task_order.h, backward_task_order.h) for the worst-case schedule.
#pragma once

#include <cstdint>

namespace mok {

// The persistent forward GEMM kernel: max_tiles routed row tiles over I = `intermediate` and
// H = `hidden`, and shared_tiles of a shared expert of `shared_intermediate` columns (0: none).
int64_t forward_trace_capacity(int64_t max_tiles, int32_t minibatch_tiles, int64_t intermediate,
                               int64_t hidden, int64_t shared_tiles, int64_t shared_intermediate);

// The persistent backward kernel, recomputing the forward (the most tasks), with num_experts
// local experts; the shared expert's set as above.
int64_t backward_trace_capacity(int64_t max_tiles, int32_t minibatch_tiles, int64_t intermediate,
                                int64_t hidden, int64_t num_experts, int64_t shared_tiles,
                                int64_t shared_intermediate);

}  // namespace mok
