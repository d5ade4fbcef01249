// The task traces' capacities from the task orders (task_trace_capacity.h).
#include "layer/task_trace_capacity.h"

#include <vector>

#include "kernels/persistent/backward_task_order.h"
#include "kernels/persistent/task_order.h"

namespace mok {

int64_t forward_trace_capacity(int64_t max_tiles, int32_t minibatch_tiles, int64_t intermediate,
                               int64_t hidden, int64_t shared_tiles, int64_t shared_intermediate) {
  return kernels::num_tasks(
      kernels::forward_gemms_plan(static_cast<int32_t>(max_tiles), minibatch_tiles, intermediate,
                                  hidden, static_cast<int32_t>(shared_tiles), shared_intermediate));
}

int64_t backward_trace_capacity(int64_t max_tiles, int32_t minibatch_tiles, int64_t intermediate,
                                int64_t hidden, int64_t num_experts, int64_t shared_tiles,
                                int64_t shared_intermediate) {
  // Every expert's weight-gradient tiles are in the order once, wherever its rows are, so any
  // placement of the row tiles gives the same count: all of them in expert 0.
  std::vector<int32_t> routed_tiles(static_cast<size_t>(num_experts) + 1,
                                    static_cast<int32_t>(max_tiles));
  routed_tiles[0] = 0;
  const std::vector<int32_t> shared_expert_tiles = {0, static_cast<int32_t>(shared_tiles)};
  kernels::BackwardPlans plans;
  plans.num_sets = shared_tiles > 0 ? 2 : 1;
  plans.sets[0] =
      kernels::backward_plan(static_cast<int32_t>(max_tiles), minibatch_tiles, true, intermediate,
                             hidden, static_cast<int32_t>(num_experts), routed_tiles.data());
  if (shared_tiles > 0)
    plans.sets[1] = kernels::backward_plan(
        static_cast<int32_t>(shared_tiles), static_cast<int32_t>(shared_tiles), true,
        shared_intermediate, hidden, 1, shared_expert_tiles.data());
  return kernels::num_tasks(plans);
}

}  // namespace mok
