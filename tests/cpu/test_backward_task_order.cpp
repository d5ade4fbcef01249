// The persistent backward's task order (src/kernels/backward_task_order.h): every task exactly
// once, every dependency satisfied by tasks with smaller tickets (so any number of resident CTAs
// makes progress), counter targets equal to the number of producers, the two-step minibatch
// pipeline, and each expert's weight-gradient tiles after the minibatch where its rows end; over
// random expert segments (empty experts included), minibatch sizes, with and without the
// recompute.
#include <gtest/gtest.h>

#include <map>
#include <tuple>
#include <vector>

#include "kernels/backward_task_order.h"
#include "mok/routing.h"

namespace mok::kernels {
namespace {

using Key = std::tuple<int, int, int, int, int, int>;  // kind, m, n, expert, matrix, block

Key key_of(const BackwardTask& task) {
  return {
      static_cast<int>(task.kind), task.m_tile, task.n_tile, task.expert, task.matrix, task.block};
}

struct Case {
  BackwardPlan plan;
  std::vector<int32_t> expert_tiles;
};

std::vector<Case> cases() {
  std::vector<Case> result;
  SplitMix64 rng(17);
  for (int i = 0; i < 60; ++i) {
    Case c;
    const int32_t experts = 1 + static_cast<int32_t>(rng.below(20));
    c.expert_tiles.push_back(0);
    for (int32_t e = 0; e < experts; ++e)
      c.expert_tiles.push_back(c.expert_tiles.back() +
                               (rng.below(4) == 0 ? 0 : static_cast<int32_t>(rng.below(9))));
    if (i % 10 == 0)  // no row tiles at all: every expert empty
      for (int32_t& tiles : c.expert_tiles) tiles = 0;
    BackwardPlan& plan = c.plan;
    plan.num_m_tiles = c.expert_tiles.back();
    plan.minibatch_tiles = 1 + static_cast<int32_t>(rng.below(12));
    plan.recompute = i % 2;
    plan.gate_up_n_tiles = 1 + static_cast<int32_t>(rng.below(4));
    plan.down_dgrad_n_tiles = 1 + static_cast<int32_t>(rng.below(3));
    plan.gate_up_dgrad_n_tiles = 1 + static_cast<int32_t>(rng.below(5));
    plan.gate_wgrad_tiles = 1 + static_cast<int32_t>(rng.below(6));
    plan.down_wgrad_tiles = 1 + static_cast<int32_t>(rng.below(6));
    plan.num_experts = experts;
    plan.combine_blocks = 1 + static_cast<int32_t>(rng.below(7));
    result.push_back(c);
  }
  return result;
}

TEST(BackwardTaskOrder, EveryTaskOnceDependenciesEarlierTargetsExact) {
  for (Case& c : cases()) {
    BackwardPlan plan = c.plan;
    plan.expert_tiles = c.expert_tiles.data();
    SCOPED_TRACE(testing::Message()
                 << "m_tiles " << plan.num_m_tiles << " minibatch " << plan.minibatch_tiles
                 << " experts " << plan.num_experts << " recompute " << plan.recompute);
    const int64_t m = plan.num_m_tiles;
    const int64_t expected = m * (2 + (plan.recompute ? plan.gate_up_n_tiles : 0) +
                                  plan.down_dgrad_n_tiles + plan.gate_up_dgrad_n_tiles) +
                             static_cast<int64_t>(plan.num_experts) * wgrad_tiles_per_expert(plan) +
                             plan.combine_blocks;
    const int64_t total = num_tasks(plan);
    ASSERT_EQ(total, expected);

    std::map<Key, int64_t> ticket_of;
    std::vector<BackwardTask> tasks;
    SegmentCursor cursor;
    for (int64_t ticket = 0; ticket < total; ++ticket) {
      const BackwardTask task = backward_task_at(plan, ticket, &cursor);
      const BackwardTask fresh = backward_task_at(plan, ticket);
      ASSERT_EQ(key_of(task), key_of(fresh)) << "the cursor walk and a fresh walk disagree";
      ASSERT_TRUE(ticket_of.emplace(key_of(task), ticket).second)
          << "ticket " << ticket << " repeats a task";
      tasks.push_back(task);
      if (task.kind == BackwardTaskKind::kWeightGrad) {
        ASSERT_GE(task.expert, 0);
        ASSERT_LT(task.expert, plan.num_experts);
        ASSERT_LT(task.m_tile, task.matrix == 2 ? plan.down_wgrad_tiles : plan.gate_wgrad_tiles);
        // In the minibatch where the expert's rows end.
        EXPECT_EQ(task.minibatch,
                  num_minibatches(plan) == 0 ? -1 : wgrad_minibatch(plan, task.expert));
      } else if (task.kind != BackwardTaskKind::kCombine) {
        ASSERT_GE(task.m_tile, 0);
        ASSERT_LT(task.m_tile, plan.num_m_tiles);
        ASSERT_EQ(task.minibatch, task.m_tile / plan.minibatch_tiles);
      }
    }
    // Producers of every counter: (counter, index) -> (count, last ticket).
    std::map<std::pair<int, int>, std::pair<int64_t, int64_t>> producers;
    auto produce = [&](BackwardCounter counter, int32_t index, int64_t ticket) {
      auto& entry = producers[{static_cast<int>(counter), index}];
      ++entry.first;
      entry.second = std::max(entry.second, ticket);
    };
    for (int64_t ticket = 0; ticket < total; ++ticket) {
      const BackwardTask& task = tasks[ticket];
      switch (task.kind) {
        case BackwardTaskKind::kRows:
          produce(BackwardCounter::kRowsReady, task.m_tile, ticket);
          break;
        case BackwardTaskKind::kRecompute:
        case BackwardTaskKind::kDownDgrad:
          produce(BackwardCounter::kRowGemmsDone, task.m_tile, ticket);
          break;
        case BackwardTaskKind::kSwiglu:
          produce(BackwardCounter::kSwigluDone, task.m_tile, ticket);
          produce(BackwardCounter::kExpertReady, expert_of_tile(plan, task.m_tile), ticket);
          break;
        case BackwardTaskKind::kGateUpDgrad:
          produce(BackwardCounter::kDxDone, 0, ticket);
          break;
        default:
          break;
      }
    }
    for (int64_t ticket = 0; ticket < total; ++ticket) {
      const BackwardDependency dependency = dependency_of(plan, tasks[ticket]);
      if (dependency.counter == BackwardCounter::kNone) continue;
      const auto found = producers.find({static_cast<int>(dependency.counter), dependency.index});
      ASSERT_NE(found, producers.end())
          << "ticket " << ticket << " waits on a counter nobody adds to";
      EXPECT_EQ(found->second.first, dependency.target)
          << "ticket " << ticket << ": the target is not the number of producers";
      EXPECT_LT(found->second.second, ticket)
          << "ticket " << ticket << " waits on a later ticket: a stall with few resident CTAs";
    }
    // Every weight-gradient tile of every expert, once (also the experts without rows).
    for (int32_t e = 0; e < plan.num_experts; ++e)
      for (int32_t matrix = 0; matrix < 3; ++matrix)
        for (int32_t t = 0; t < (matrix == 2 ? plan.down_wgrad_tiles : plan.gate_wgrad_tiles); ++t)
          EXPECT_EQ(ticket_of.count(
                        Key{static_cast<int>(BackwardTaskKind::kWeightGrad), t, -1, e, matrix, -1}),
                    1u)
              << "expert " << e << " matrix " << matrix << " tile " << t;
    // The pipeline: the down dgrad tiles of b + 1 come before the SwiGLU backward of b.
    for (int32_t b = 0; b + 1 < num_minibatches(plan); ++b) {
      const int32_t next = (b + 1) * plan.minibatch_tiles;
      const int64_t swiglu_b = ticket_of.at(Key{static_cast<int>(BackwardTaskKind::kSwiglu),
                                                b * plan.minibatch_tiles, -1, -1, -1, -1});
      int32_t m_tile = -1, n_tile = -1;
      grouped_tile(0, minibatch_tiles(plan, b + 1), plan.down_dgrad_n_tiles, &m_tile, &n_tile);
      const int64_t dgrad_next = ticket_of.at(
          Key{static_cast<int>(BackwardTaskKind::kDownDgrad), next + m_tile, n_tile, -1, -1, -1});
      EXPECT_LT(dgrad_next, swiglu_b) << "minibatch " << b;
      // Two steps deep: the readers of swiglu(b) come after swiglu(b + 1).
      const int64_t swiglu_next =
          ticket_of.at(Key{static_cast<int>(BackwardTaskKind::kSwiglu), next, -1, -1, -1, -1});
      grouped_tile(0, minibatch_tiles(plan, b), plan.gate_up_dgrad_n_tiles, &m_tile, &n_tile);
      const int64_t dx_b = ticket_of.at(Key{static_cast<int>(BackwardTaskKind::kGateUpDgrad),
                                            b * plan.minibatch_tiles + m_tile, n_tile, -1, -1, -1});
      EXPECT_LT(swiglu_next, dx_b) << "minibatch " << b;
    }
  }
}

TEST(BackwardTaskOrder, ExpertOfTileFindsTheOwner) {
  const std::vector<int32_t> tiles = {0, 0, 3, 3, 4, 9, 9};  // experts 0, 2, 4, 5 empty
  BackwardPlan plan{};
  plan.num_experts = 6;
  plan.expert_tiles = tiles.data();
  const int32_t want[] = {1, 1, 1, 3, 4, 4, 4, 4, 4};
  for (int32_t m = 0; m < 9; ++m) EXPECT_EQ(expert_of_tile(plan, m), want[m]) << "tile " << m;
}

}  // namespace
}  // namespace mok::kernels
