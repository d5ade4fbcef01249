// The persistent forward's task order (src/kernels/task_order.h): every task exactly once,
// every dependency satisfied by tasks with smaller tickets (so any number of resident CTAs
// makes progress), counter targets equal to the number of producers, and the minibatch
// pipeline (the gate/up tiles of b+1 come between the gate/up and the down tiles of b); the
// same with the GEMM tiles only (memory_tasks = 0, the persistent GEMM kernel), with and
// without the shared expert's tiles (after every routed tile, before the combine); and under
// expert parallelism (push tasks after each minibatch's down tiles), a simulated group of ranks
// that finishes with any number of resident CTAs per rank.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "kernels/persistent/task_order.h"
#include "mok/testing/routing.h"

namespace mok::kernels {
namespace {

using Key = std::tuple<int, int, int, int>;  // kind, m_tile, n_tile, block

Key key_of(const Task& task) {
  return {static_cast<int>(task.kind), task.m_tile, task.n_tile, task.block};
}

// The counters a finished task adds one to, as (CounterKind, index); a push adds to the other
// ranks' kRowsPushed, which the simulation below counts.
std::vector<std::pair<int, int>> counters_produced(const Task& task) {
  switch (task.kind) {
    case TaskKind::kGather:
      return {{static_cast<int>(CounterKind::kRowsGathered), task.m_tile}};
    case TaskKind::kGateUp:
      return {{static_cast<int>(CounterKind::kGateUpDone), task.m_tile}};
    case TaskKind::kSharedGateUp:
      return {{static_cast<int>(CounterKind::kSharedGateUpDone), task.m_tile}};
    case TaskKind::kDown:
      return {{static_cast<int>(CounterKind::kDownDone), 0},
              {static_cast<int>(CounterKind::kRowDownDone), task.m_tile}};
    case TaskKind::kSharedDown:
      return {{static_cast<int>(CounterKind::kDownDone), 0}};
    case TaskKind::kPush:
    case TaskKind::kCombine:
      return {};
  }
  return {};
}

std::vector<ForwardPlan> plans() {
  std::vector<ForwardPlan> result = {
      {1, 1, 1, 1, 1},    {0, 32, 16, 28, 4}, {272, 32, 16, 28, 64}, {7, 3, 2, 5, 3},
      {64, 64, 6, 8, 16}, {65, 64, 6, 8, 16}, {9, 1, 3, 2, 2},       {17, 8, 9, 1, 1},
  };
  SplitMix64 rng(7);
  for (int i = 0; i < 40; ++i)
    result.push_back({static_cast<int32_t>(rng.below(300)), static_cast<int32_t>(1 + rng.below(40)),
                      static_cast<int32_t>(1 + rng.below(20)),
                      static_cast<int32_t>(1 + rng.below(30)),
                      static_cast<int32_t>(1 + rng.below(50))});
  const size_t without_shared = result.size();
  for (size_t i = 0; i < without_shared; ++i) {
    ForwardPlan shared = result[i];
    shared.shared_m_tiles = static_cast<int32_t>(i % 3 == 0 ? 1 : rng.below(40));
    shared.shared_gate_up_n_tiles = static_cast<int32_t>(1 + rng.below(20));
    shared.shared_down_n_tiles = static_cast<int32_t>(1 + rng.below(30));
    result.push_back(shared);
  }
  const size_t with_memory_tasks = result.size();
  for (size_t i = 0; i < with_memory_tasks; ++i) {
    ForwardPlan gemm_only = result[i];
    gemm_only.memory_tasks = 0;
    result.push_back(gemm_only);
  }
  for (size_t i = 0; i < with_memory_tasks; i += 3) {  // expert parallelism (and without memory
    for (int32_t memory_tasks : {1, 0}) {              // tasks: the GEMM tiles only, no pushes)
      ForwardPlan grouped = result[i];
      grouped.num_ranks = static_cast<int32_t>(2 + rng.below(7));
      grouped.memory_tasks = memory_tasks;
      result.push_back(grouped);
    }
  }
  return result;
}

TEST(TaskOrder, EveryTaskOnceAndDependenciesEarlier) {
  for (const ForwardPlan& plan : plans()) {
    SCOPED_TRACE(testing::Message()
                 << "m_tiles " << plan.num_m_tiles << " minibatch " << plan.minibatch_tiles
                 << " gate_up_n " << plan.gate_up_n_tiles << " down_n " << plan.down_n_tiles
                 << " combine " << plan.combine_blocks << " memory tasks " << plan.memory_tasks
                 << " shared m " << plan.shared_m_tiles << " gate_up_n "
                 << plan.shared_gate_up_n_tiles << " down_n " << plan.shared_down_n_tiles
                 << " ranks " << plan.num_ranks);
    const int64_t total = num_tasks(plan);
    const int64_t memory = plan.memory_tasks != 0;
    const int64_t pushes = plan.num_ranks > 1 && memory;
    const int64_t expected = static_cast<int64_t>(plan.num_m_tiles) *
                                 (memory + pushes + plan.gate_up_n_tiles + plan.down_n_tiles) +
                             memory * plan.combine_blocks +
                             static_cast<int64_t>(plan.shared_m_tiles) *
                                 (plan.shared_gate_up_n_tiles + plan.shared_down_n_tiles);
    ASSERT_EQ(total, expected);
    std::map<Key, int64_t> ticket_of;
    std::vector<Task> tasks;
    for (int64_t ticket = 0; ticket < total; ++ticket) {
      const Task task = task_at(plan, ticket);
      ASSERT_TRUE(ticket_of.emplace(key_of(task), ticket).second)
          << "ticket " << ticket << " repeats a task";
      tasks.push_back(task);
      if (plan.memory_tasks == 0)
        ASSERT_TRUE(task.kind != TaskKind::kGather && task.kind != TaskKind::kCombine &&
                    task.kind != TaskKind::kPush)
            << "ticket " << ticket << " is a memory task in a GEMM-only order";
      if (plan.num_ranks == 1)
        ASSERT_NE(task.kind, TaskKind::kPush) << "ticket " << ticket << ": a push on one rank";
      ASSERT_EQ(remote_dependency_of(plan, task).counter, task.kind == TaskKind::kCombine && pushes
                                                              ? CounterKind::kRowsPushed
                                                              : CounterKind::kNone)
          << "ticket " << ticket;
      if (is_shared(task.kind)) {
        ASSERT_GE(task.m_tile, 0);
        ASSERT_LT(task.m_tile, plan.shared_m_tiles);
        ASSERT_LT(task.n_tile, task.kind == TaskKind::kSharedGateUp ? plan.shared_gate_up_n_tiles
                                                                    : plan.shared_down_n_tiles);
        ASSERT_EQ(task.minibatch, -1);
      } else if (task.kind != TaskKind::kCombine) {
        ASSERT_GE(task.m_tile, 0);
        ASSERT_LT(task.m_tile, plan.num_m_tiles);
        ASSERT_EQ(task.minibatch, task.m_tile / plan.minibatch_tiles);
      }
    }
    // Producers of every counter, and the last ticket among them.
    std::map<std::pair<int, int>, std::pair<int64_t, int64_t>>
        producers;  // (counter, index) -> (count, last)
    for (int64_t ticket = 0; ticket < total; ++ticket) {
      const Task& task = tasks[ticket];
      for (const auto& counter : counters_produced(task)) {
        auto& [count, last] = producers[counter];
        ++count;
        last = ticket;
      }
    }
    for (int64_t ticket = 0; ticket < total; ++ticket) {
      const Dependency dependency = dependency_of(plan, tasks[ticket]);
      if (dependency.counter == CounterKind::kNone) continue;
      const auto found = producers.find({static_cast<int>(dependency.counter), dependency.index});
      const int64_t count = found == producers.end() ? 0 : found->second.first;
      EXPECT_EQ(dependency.target, count)
          << "ticket " << ticket << ": the target is not the producer count";
      if (count > 0)
        EXPECT_LT(found->second.second, ticket) << "ticket " << ticket << " waits on a later task";
    }
  }
}

TEST(TaskOrder, NextMinibatchsGateUpTilesSeparateAMinibatchsGateUpAndDownTiles) {
  for (int32_t memory_tasks : {1, 0}) {
    ForwardPlan plan{96, 32, 16, 28, 8};
    plan.memory_tasks = memory_tasks;
    for (int32_t b = 0; b + 1 < num_minibatches(plan); ++b) {
      int64_t last_gate_up_of_b = -1, first_gate_up_of_next = -1, last_gate_up_of_next = -1,
              first_down_of_b = -1, last_gather_of_next = -1;
      for (int64_t ticket = 0; ticket < num_tasks(plan); ++ticket) {
        const Task task = task_at(plan, ticket);
        if (task.kind == TaskKind::kGateUp && task.minibatch == b) last_gate_up_of_b = ticket;
        if (task.kind == TaskKind::kGateUp && task.minibatch == b + 1) {
          if (first_gate_up_of_next < 0) first_gate_up_of_next = ticket;
          last_gate_up_of_next = ticket;
        }
        if (task.kind == TaskKind::kDown && task.minibatch == b && first_down_of_b < 0)
          first_down_of_b = ticket;
        if (task.kind == TaskKind::kGather && task.minibatch == b + 1) last_gather_of_next = ticket;
      }
      EXPECT_LT(last_gate_up_of_b, first_gate_up_of_next) << "minibatch " << b;
      EXPECT_LT(last_gate_up_of_next, first_down_of_b) << "minibatch " << b;
      EXPECT_LT(last_gather_of_next, first_gate_up_of_next) << "minibatch " << b;
      if (memory_tasks == 0) EXPECT_EQ(last_gather_of_next, -1);
    }
  }
}

// The shared expert's tiles come after every routed tile (they fill the routed tiles' last
// wave) and before the combine; its down tiles after all of its gate/up tiles.
TEST(TaskOrder, SharedExpertTilesFollowTheRoutedTiles) {
  for (int32_t memory_tasks : {1, 0}) {
    ForwardPlan plan{40, 16, 6, 5, 8};
    plan.memory_tasks = memory_tasks;
    plan.shared_m_tiles = 12;
    plan.shared_gate_up_n_tiles = 3;
    plan.shared_down_n_tiles = 5;
    int64_t last_routed = -1, first_shared = -1, last_shared_gate_up = -1, first_shared_down = -1,
            last_shared = -1, first_combine = -1;
    for (int64_t ticket = 0; ticket < num_tasks(plan); ++ticket) {
      const Task task = task_at(plan, ticket);
      if (is_shared(task.kind)) {
        if (first_shared < 0) first_shared = ticket;
        last_shared = ticket;
      } else if (task.kind == TaskKind::kCombine) {
        if (first_combine < 0) first_combine = ticket;
      } else {
        last_routed = ticket;
      }
      if (task.kind == TaskKind::kSharedGateUp) last_shared_gate_up = ticket;
      if (task.kind == TaskKind::kSharedDown && first_shared_down < 0) first_shared_down = ticket;
    }
    EXPECT_EQ(last_shared - first_shared + 1, 12 * (3 + 5));
    EXPECT_LT(last_routed, first_shared);
    EXPECT_LT(last_shared_gate_up, first_shared_down);
    if (memory_tasks != 0) EXPECT_LT(last_shared, first_combine);
  }
}

// A scheduler whose tickets only grow keeps a cursor: the same tasks as the walk from the start,
// for any increasing sequence of tickets (here: every third ticket, with random skips).
TEST(TaskOrder, CursorWalkGivesTheSameTasks) {
  SplitMix64 rng(11);
  for (const ForwardPlan& plan : plans()) {
    SegmentCursor cursor;
    for (int64_t ticket = static_cast<int64_t>(rng.below(3)); ticket < num_tasks(plan);
         ticket += 1 + static_cast<int64_t>(rng.below(5))) {
      const Task want = task_at(plan, ticket), got = task_at(plan, ticket, &cursor);
      ASSERT_EQ(key_of(got), key_of(want)) << "ticket " << ticket;
      ASSERT_EQ(got.minibatch, want.minibatch) << "ticket " << ticket;
    }
  }
}

TEST(TaskOrder, TilesOfAGroupShareWeightTiles) {
  // Within a gate/up segment, consecutive tickets walk up to 8 row tiles at one n before the
  // next n: CTAs that run together read the same weight tile.
  const ForwardPlan plan{16, 16, 4, 2, 1};
  const int64_t start = 16;  // after gather(0)
  for (int64_t i = 0; i < 8; ++i) {
    const Task task = task_at(plan, start + i);
    EXPECT_EQ(task.kind, TaskKind::kGateUp);
    EXPECT_EQ(task.n_tile, 0);
    EXPECT_EQ(task.m_tile, i);
  }
  EXPECT_EQ(task_at(plan, start + 8).n_tile, 1);
}

}  // namespace
}  // namespace mok::kernels

namespace mok::kernels {
namespace {

// A group of ranks, each running its own order on its own resident CTAs: a CTA takes its rank's
// next ticket, waits for the task's dependency here and (a combine) for the rows the other ranks
// push to its block, then for a communication slot (a gather or push runs on at most
// `comm_slots` CTAs of the rank at once), and runs for a random time. Each push delivers random
// row counts to the other ranks' combine blocks; a combine's target is what its rank's
// routing counts, the sum of them. The group must finish, whatever the CTA counts (one
// included), the slot counts and the times: no wait may need a task that cannot start.
struct SimCta {
  enum class State { kIdle, kWaiting, kRunning } state = State::kIdle;
  Task task{};
  int remaining = 0;
};

bool is_communication(TaskKind kind) {
  return kind == TaskKind::kGather || kind == TaskKind::kPush;
}

TEST(TaskOrder, ExpertParallelGroupFinishesWithAnyResidentCtas) {
  SplitMix64 rng(23);
  for (int trial = 0; trial < 60; ++trial) {
    const int ranks = static_cast<int>(2 + rng.below(7));
    const int32_t minibatch = static_cast<int32_t>(1 + rng.below(6));
    const int32_t gate_up_n = static_cast<int32_t>(1 + rng.below(4));
    const int32_t down_n = static_cast<int32_t>(1 + rng.below(4));
    const int32_t blocks = static_cast<int32_t>(1 + rng.below(6));
    std::vector<ForwardPlan> plan(ranks);
    std::vector<int> ctas(ranks), comm_slots(ranks);
    for (int r = 0; r < ranks; ++r) {
      plan[r] =
          ForwardPlan{static_cast<int32_t>(rng.below(14)), minibatch, gate_up_n, down_n, blocks};
      plan[r].num_ranks = ranks;
      if (rng.below(3) == 0) {
        plan[r].shared_m_tiles = static_cast<int32_t>(1 + rng.below(3));
        plan[r].shared_gate_up_n_tiles = 1;
        plan[r].shared_down_n_tiles = down_n;
      }
      ctas[r] = static_cast<int>(1 + (rng.below(2) ? rng.below(3) : rng.below(40)));
      comm_slots[r] = static_cast<int>(1 + rng.below(ctas[r]));
    }
    // rows[s][m][r * blocks + k]: what push(m) of rank s delivers to block k of rank r.
    std::vector<std::vector<std::vector<int>>> rows(ranks);
    std::vector<std::vector<int64_t>> pushed_target(ranks, std::vector<int64_t>(blocks, 0));
    for (int s = 0; s < ranks; ++s) {
      rows[s].resize(plan[s].num_m_tiles, std::vector<int>(ranks * blocks, 0));
      for (int32_t m = 0; m < plan[s].num_m_tiles; ++m)
        for (int r = 0; r < ranks; ++r)
          for (int32_t k = 0; k < blocks; ++k)
            if (r != s && rng.below(3) == 0) {
              rows[s][m][r * blocks + k] = static_cast<int>(1 + rng.below(5));
              pushed_target[r][k] += rows[s][m][r * blocks + k];
            }
    }
    std::vector<std::map<std::pair<int, int>, int64_t>> counter(ranks);
    std::vector<std::vector<int64_t>> pushed(ranks, std::vector<int64_t>(blocks, 0));
    std::vector<std::vector<SimCta>> cta(ranks);
    std::vector<int64_t> next_ticket(ranks, 0), finished(ranks, 0);
    std::vector<int> running_comm(ranks, 0);
    for (int r = 0; r < ranks; ++r) cta[r].resize(ctas[r]);
    int64_t all_tasks = 0;
    for (int r = 0; r < ranks; ++r) all_tasks += num_tasks(plan[r]);
    int64_t done = 0;
    SCOPED_TRACE(testing::Message() << "trial " << trial << ", " << ranks << " ranks");
    for (int step = 0; done < all_tasks; ++step) {
      bool moved = false;
      for (int r = 0; r < ranks; ++r) {
        for (SimCta& c : cta[r]) {
          if (c.state == SimCta::State::kIdle && next_ticket[r] < num_tasks(plan[r])) {
            c.task = task_at(plan[r], next_ticket[r]++);
            c.state = SimCta::State::kWaiting;
            moved = true;
          }
          if (c.state != SimCta::State::kWaiting) continue;
          const Dependency local = dependency_of(plan[r], c.task);
          if (local.counter != CounterKind::kNone &&
              counter[r][{static_cast<int>(local.counter), local.index}] < local.target)
            continue;
          const Dependency remote = remote_dependency_of(plan[r], c.task);
          if (remote.counter == CounterKind::kRowsPushed) {
            ASSERT_EQ(remote.target, kTargetFromRouting);
            if (pushed[r][remote.index] < pushed_target[r][remote.index]) continue;
          }
          if (is_communication(c.task.kind)) {
            if (running_comm[r] >= comm_slots[r]) continue;
            ++running_comm[r];
          }
          c.state = SimCta::State::kRunning;
          c.remaining = static_cast<int>(1 + rng.below(6));
          moved = true;
        }
      }
      for (int r = 0; r < ranks; ++r)
        for (SimCta& c : cta[r]) {
          if (c.state != SimCta::State::kRunning) continue;
          moved = true;  // time passes for a running task
          if (--c.remaining > 0) continue;
          for (const auto& produced : counters_produced(c.task)) ++counter[r][produced];
          if (c.task.kind == TaskKind::kPush)
            for (int d = 0; d < ranks; ++d)
              for (int32_t k = 0; k < blocks; ++k)
                pushed[d][k] += rows[r][c.task.m_tile][d * blocks + k];
          if (is_communication(c.task.kind)) --running_comm[r];
          c.state = SimCta::State::kIdle;
          ++finished[r];
          ++done;
          moved = true;
        }
      ASSERT_TRUE(moved) << "the group stopped at step " << step << " with " << all_tasks - done
                         << " of " << all_tasks << " tasks left";
    }
    for (int r = 0; r < ranks; ++r) {
      EXPECT_EQ(finished[r], num_tasks(plan[r])) << "rank " << r;
      for (int32_t k = 0; k < blocks; ++k) EXPECT_EQ(pushed[r][k], pushed_target[r][k]);
    }
  }
}

}  // namespace
}  // namespace mok::kernels
