// The persistent kernels' task-trace capacities (src/layer/task_trace_capacity.h): derived from
// the task orders, they equal the tile counts of the worst-case schedule at the model shapes
// (counted by hand below, from the orders' definitions), and no routing's launch takes more
// tickets than they hold.
#include <gtest/gtest.h>

#include <vector>

#include "kernels/persistent/backward_task_order.h"
#include "kernels/persistent/task_order.h"
#include "layer/task_trace_capacity.h"
#include "mok/testing/routing.h"

namespace mok {
namespace {

int64_t over(int64_t extent, int64_t tile) { return (extent + tile - 1) / tile; }

struct Shape {
  int64_t hidden, intermediate, experts, max_tiles, shared_intermediate, shared_tiles;
};

// dsv3_local, qwen3, a shared expert of another width, odd extents (H, I multiples of 64).
const Shape kShapes[] = {{7168, 2048, 32, 287, 0, 0},
                         {2048, 768, 128, 640, 0, 0},
                         {7168, 2048, 32, 287, 2048, 32},
                         {1088, 320, 5, 19, 576, 3}};

TEST(TaskTraceCapacity, CountsEveryTileOfTheWorstCaseSchedule) {
  for (const Shape& s : kShapes) {
    const int64_t H = s.hidden, I = s.intermediate, Is = s.shared_intermediate;
    // Forward: gate/up (128 + 128 columns) and down (256 columns) tiles per row tile.
    const int64_t forward = s.max_tiles * (over(I, 128) + over(H, 256)) +
                            s.shared_tiles * (over(Is, 128) + over(H, 256));
    // Backward: rows, swiglu, recompute, down dgrad, gate/up dgrad per row tile; gate, up and
    // down weight-gradient tiles per expert.
    const auto backward_set = [&](int64_t tiles, int64_t inter, int64_t experts) {
      return tiles * (2 + over(inter, 128) + over(inter, 256) + over(H, 256)) +
             experts * (2 * over(inter, 128) * over(H, 256) + over(H, 128) * over(inter, 256));
    };
    const int64_t backward = backward_set(s.max_tiles, I, s.experts) +
                             (s.shared_tiles > 0 ? backward_set(s.shared_tiles, Is, 1) : 0);
    for (int32_t minibatch_tiles : {1, 4, 8, 1000}) {
      EXPECT_EQ(forward_trace_capacity(s.max_tiles, minibatch_tiles, I, H, s.shared_tiles, Is),
                forward)
          << "H " << H << " I " << I;
      EXPECT_EQ(backward_trace_capacity(s.max_tiles, minibatch_tiles, I, H, s.experts,
                                        s.shared_tiles, Is),
                backward)
          << "H " << H << " I " << I;
    }
  }
}

TEST(TaskTraceCapacity, HoldsEveryRoutingsTickets) {
  SplitMix64 rng(5);
  for (int i = 0; i < 200; ++i) {
    const int64_t H = 64 * (1 + static_cast<int64_t>(rng.below(40)));
    const int64_t I = 64 * (1 + static_cast<int64_t>(rng.below(40)));
    const int32_t experts = 1 + static_cast<int32_t>(rng.below(16));
    const int32_t max_tiles = experts + static_cast<int32_t>(rng.below(40));
    const int32_t minibatch_tiles = 1 + static_cast<int32_t>(rng.below(10));
    // A routing's row tiles: at most max_tiles in all, empty experts included.
    std::vector<int32_t> expert_tiles = {0};
    for (int32_t e = 0; e < experts; ++e) {
      const int32_t room = max_tiles - expert_tiles.back();
      expert_tiles.push_back(expert_tiles.back() +
                             static_cast<int32_t>(rng.below(static_cast<uint64_t>(room) / 2 + 1)));
    }
    const int32_t tiles = expert_tiles.back();
    const kernels::ForwardPlan forward =
        kernels::forward_gemms_plan(tiles, minibatch_tiles, I, H, 0, 0);
    EXPECT_LE(kernels::num_tasks(forward),
              forward_trace_capacity(max_tiles, minibatch_tiles, I, H, 0, 0));
    for (bool recompute : {false, true}) {
      kernels::BackwardPlans plans;
      plans.num_sets = 1;
      plans.sets[0] = kernels::backward_plan(tiles, minibatch_tiles, recompute, I, H, experts,
                                             expert_tiles.data());
      EXPECT_LE(kernels::num_tasks(plans),
                backward_trace_capacity(max_tiles, minibatch_tiles, I, H, experts, 0, 0))
          << "case " << i;
    }
  }
}

}  // namespace
}  // namespace mok
