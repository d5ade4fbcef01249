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

#include "kernels/persistent/backward_task_order.h"
#include "mok/testing/routing.h"

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

// Every dependency of `tasks` (one plan's tasks, at `tickets` of the launch) is on a counter
// that tasks with smaller tickets add to, with a target equal to their number.
void check_dependencies(const BackwardPlan& plan, const std::vector<int64_t>& tickets,
                        const std::vector<BackwardTask>& tasks) {
  // Producers of every counter: (counter, index) -> (count, last ticket).
  std::map<std::pair<int, int>, std::pair<int64_t, int64_t>> producers;
  auto produce = [&](BackwardCounter counter, int32_t index, int64_t ticket) {
    auto& entry = producers[{static_cast<int>(counter), index}];
    ++entry.first;
    entry.second = std::max(entry.second, ticket);
  };
  for (size_t i = 0; i < tasks.size(); ++i) {
    const BackwardTask& task = tasks[i];
    const int64_t ticket = tickets[i];
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
  for (size_t i = 0; i < tasks.size(); ++i) {
    const int64_t ticket = tickets[i];
    const BackwardDependency dependency = dependency_of(plan, tasks[i]);
    if (dependency.counter == BackwardCounter::kNone) continue;
    const auto found = producers.find({static_cast<int>(dependency.counter), dependency.index});
    ASSERT_NE(found, producers.end())
        << "ticket " << ticket << " waits on a counter nobody adds to";
    EXPECT_EQ(found->second.first, dependency.target)
        << "ticket " << ticket << ": the target is not the number of producers";
    EXPECT_LT(found->second.second, ticket)
        << "ticket " << ticket << " waits on a later ticket: a stall with few resident CTAs";
  }
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
    std::vector<int64_t> tickets;
    SegmentCursor cursor;
    for (int64_t ticket = 0; ticket < total; ++ticket) {
      const BackwardTask task = backward_task_at(plan, ticket, &cursor);
      const BackwardTask fresh = backward_task_at(plan, ticket);
      ASSERT_EQ(key_of(task), key_of(fresh)) << "the cursor walk and a fresh walk disagree";
      ASSERT_TRUE(ticket_of.emplace(key_of(task), ticket).second)
          << "ticket " << ticket << " repeats a task";
      tasks.push_back(task);
      tickets.push_back(ticket);
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
    check_dependencies(plan, tickets, tasks);
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

// With the shared expert (BackwardPlans): every task of both plans once, the cursor walk equal to
// a fresh one, each plan's dependencies on earlier tickets of its own plan with exact targets,
// and the shared tasks merged into the routed order (the first tickets are the shared expert's
// down dgrad tiles; none of its tasks after the routed combine).
TEST(BackwardTaskOrder, SharedExpertMergesIntoTheRoutedOrder) {
  SplitMix64 rng(23);
  for (Case& c : cases()) {
    BackwardPlans plans{};
    plans.num_sets = 2;
    plans.sets[0] = c.plan;
    plans.sets[0].expert_tiles = c.expert_tiles.data();
    const int32_t shared_tiles = 1 + static_cast<int32_t>(rng.below(12));
    const std::vector<int32_t> shared_expert_tiles = {0, shared_tiles};
    BackwardPlan& shared = plans.sets[1];
    shared = c.plan;
    shared.num_m_tiles = shared_tiles;
    shared.minibatch_tiles = shared_tiles;
    shared.gate_up_n_tiles = 1 + static_cast<int32_t>(rng.below(4));
    shared.down_dgrad_n_tiles = 1 + static_cast<int32_t>(rng.below(3));
    shared.gate_wgrad_tiles = 1 + static_cast<int32_t>(rng.below(6));
    shared.down_wgrad_tiles = 1 + static_cast<int32_t>(rng.below(6));
    shared.num_experts = 1;
    shared.combine_blocks = 0;
    shared.expert_tiles = shared_expert_tiles.data();
    SCOPED_TRACE(testing::Message() << "routed m_tiles " << c.plan.num_m_tiles << " minibatch "
                                    << c.plan.minibatch_tiles << " shared m_tiles " << shared_tiles
                                    << " recompute " << c.plan.recompute);
    const int64_t total = num_tasks(plans);
    ASSERT_EQ(total, num_tasks(plans.sets[0]) + num_tasks(plans.sets[1]));
    std::vector<BackwardTask> tasks_of[2];
    std::vector<int64_t> tickets_of[2];
    std::map<std::pair<int, Key>, int64_t> ticket_of;
    int64_t last_shared = -1, first_routed_combine = -1;
    SegmentCursor cursor;
    for (int64_t ticket = 0; ticket < total; ++ticket) {
      const BackwardTask task = backward_task_at(plans, ticket, &cursor);
      const BackwardTask fresh = backward_task_at(plans, ticket);
      ASSERT_EQ(task.set, fresh.set);
      ASSERT_EQ(key_of(task), key_of(fresh)) << "the cursor walk and a fresh walk disagree";
      ASSERT_TRUE(ticket_of.emplace(std::make_pair(task.set, key_of(task)), ticket).second)
          << "ticket " << ticket << " repeats a task";
      tasks_of[task.set].push_back(task);
      tickets_of[task.set].push_back(ticket);
      if (task.set == 1) last_shared = ticket;
      if (task.set == 0 && task.kind == BackwardTaskKind::kCombine && first_routed_combine < 0)
        first_routed_combine = ticket;
    }
    ASSERT_EQ(static_cast<int64_t>(tasks_of[1].size()), num_tasks(plans.sets[1]));
    for (int set = 0; set < 2; ++set) {
      SCOPED_TRACE(set == 0 ? "routed" : "shared");
      check_dependencies(plans.sets[set], tickets_of[set], tasks_of[set]);
    }
    // The shared expert's first tasks lead the order: its rows (and recompute) and down dgrad.
    const BackwardTask first = backward_task_at(plans, 0);
    EXPECT_EQ(first.set, 1);
    EXPECT_EQ(first.kind, BackwardTaskKind::kRows);
    EXPECT_LT(last_shared, first_routed_combine);
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
