// The order of work of the persistent forward kernel (DESIGN.md §2.7), as plain arithmetic that
// host and device share: ticket t of a launch names one task, and every task waits only on
// tasks with smaller tickets, so the kernel progresses with any number of resident CTAs.
//
// Tasks, per minibatch b of `minibatch_tiles` 128-row tiles (the last one may be short):
//   gather(b, m)        copy the routed x rows of row tile m                     (memory-bound)
//   gate_up(b, m, n)    128 x (128 gate + 128 up) tile with the SwiGLU epilogue  waits: gather(m)
//   down(b, m, n)       128 x 256 tile of the expert output rows      waits: all gate_up(m, *)
//   shared_gate_up(m, n)  the shared expert's gate/up tile: every token, one expert
//   shared_down(m, n)   its down tile                       waits: all shared_gate_up(m, *)
//   push(b, m)          expert parallelism (num_ranks > 1): row tile m's rows into their
//                       source ranks' combine slots               waits: all down(m, *)
//   combine(k)          the fixed-order sum of token block k       waits: every (shared) down
//                       here; with pushes also the rows every other rank pushes to block k
// Order (a software pipeline over minibatches: the gate/up tiles of b+1 run between the gate/up
// and the down tiles of b, so a down tile rarely waits for a gate/up tile still in flight):
//   gather(0) gate_up(0) | gather(1) gate_up(1) down(0) push(0) | gather(2) gate_up(2) down(1)
//   push(1) | ... down(last) push(last) | shared_gate_up(*) | shared_down(*) | combine(*)
// Under expert parallelism the gather of a row tile is the pull dispatch of its rows (each from
// its source rank's published x), and push(b, m) sends its rows back as soon as they exist
// (docs/design.md, "communication inside the persistent kernels": a plan; the device kernels
// run the GEMM tiles only so far). The one wait on another rank is combine(k) on the rows
// pushed to it (remote_dependency_of), and every push is earlier in its own rank's order than
// that rank's combines, so the group finishes with any number of resident CTAs per rank.
// The shared expert's tiles depend on no routed task: after the routed ones, they fill the
// routed down tiles' last wave (and its own down tiles, shorter, make the kernel's tail).
// With plan.memory_tasks = 0 the order holds the GEMM tiles only (the persistent GEMM kernel:
// the gather runs beside it on the producer warps or before it, the combine after it), and a
// gate/up tile depends on nothing in the order.
// Inside a GEMM stage, tiles go in groups of up to 8 row tiles (about one expert) swept n-major,
// as the standalone GEMM kernel does, so CTAs running together share weight tiles in L2.
// The plan's num_m_tiles comes from the schedule header on the device: the order is computed
// on the fly, never stored.
#pragma once

#include <stdint.h>

#include "mok/dtype.h"

namespace mok::kernels {

enum class TaskKind : int32_t {
  kGather = 0,
  kGateUp = 1,
  kDown = 2,
  kCombine = 3,
  kSharedGateUp = 4,
  kSharedDown = 5,
  kPush = 6,
};

MOK_HOST_DEVICE inline bool is_gate_up(TaskKind kind) {
  return kind == TaskKind::kGateUp || kind == TaskKind::kSharedGateUp;
}
MOK_HOST_DEVICE inline bool is_shared(TaskKind kind) {
  return kind == TaskKind::kSharedGateUp || kind == TaskKind::kSharedDown;
}

struct ForwardPlan {
  int32_t num_m_tiles;       // 128-row tiles of the schedule (header.num_tiles)
  int32_t minibatch_tiles;   // MoeConfig::minibatch_size / 128
  int32_t gate_up_n_tiles;   // ceil(I / 128)
  int32_t down_n_tiles;      // ceil(H / 256)
  int32_t combine_blocks;    // token blocks of the combine
  int32_t memory_tasks = 1;  // 0: gather and combine are not in the order (GEMM tiles only)
  // The shared expert (0 tiles: none, or not in this launch): its 128-row tiles over the
  // tokens, ceil(Is / 128) gate/up and ceil(H / 256) down column tiles.
  int32_t shared_m_tiles = 0;
  int32_t shared_gate_up_n_tiles = 0;
  int32_t shared_down_n_tiles = 0;
  // Expert parallelism: the group's ranks. With more than one (and memory tasks) every routed
  // row tile has a push task, and the combine also waits for the other ranks' pushes.
  int32_t num_ranks = 1;
};

struct Task {
  TaskKind kind;
  int32_t minibatch;  // -1 for combine and the shared expert's tiles
  int32_t m_tile;     // row tile (gather, gate_up, down: the routed schedule's; shared: the
                      // shared expert's), -1 for combine
  int32_t n_tile;     // column tile (gate_up, down), -1 otherwise
  int32_t block;      // combine block, -1 otherwise
};

// What a task waits for before it starts: a counter reaching a target. Producers add 1 to the
// counter when they finish (release), the waiter acquires it. kNone: starts at once.
enum class CounterKind : int32_t {
  kNone = 0,
  kRowsGathered = 1,
  kGateUpDone = 2,
  kDownDone = 3,
  kSharedGateUpDone = 4,
  kRowDownDone = 5,  // a routed row tile's down tiles (push waits on it)
  kRowsPushed = 6,   // rows the other ranks pushed into a combine block's slots (on this rank)
};
// A target the order does not know: the number of rows the other ranks push into the block,
// which the rank counts from its own routing (its tokens' slots routed to other ranks' experts).
constexpr int64_t kTargetFromRouting = -1;
struct Dependency {
  CounterKind counter;
  int32_t index;   // row tile for kRowsGathered / k(Shared)GateUpDone / kRowDownDone; combine
                   // block for kRowsPushed; 0 for kDownDone
  int64_t target;  // number of producer tasks (kRowsPushed: rows, kTargetFromRouting)
};

// The tile sizes the orders count in: the expert GEMM's BLOCK_M and BLOCK_N (the task kinds'
// headers, forward_tasks.cuh and backward_tasks.cuh, assert they agree); a gate/up tile holds 128
// gate and 128 up columns.
constexpr int32_t kOrderTileRows = 128;
constexpr int32_t kOrderTileColumns = 256;
constexpr int32_t kOrderGateUpColumns = 128;

MOK_HOST_DEVICE inline int32_t tiles_over(int64_t extent, int32_t tile) {
  return static_cast<int32_t>((extent + tile - 1) / tile);
}

// The plan of one launch of the persistent GEMM kernel (GEMM tiles only): num_m_tiles routed row
// tiles over I = `intermediate`, H = `hidden`, and shared_m_tiles of a shared expert of
// `shared_intermediate` columns (0: none in this launch). The kernel and the host (the task
// trace's capacity) build it here.
MOK_HOST_DEVICE inline ForwardPlan forward_gemms_plan(int32_t num_m_tiles, int32_t minibatch_tiles,
                                                      int64_t intermediate, int64_t hidden,
                                                      int32_t shared_m_tiles,
                                                      int64_t shared_intermediate) {
  ForwardPlan plan;
  plan.num_m_tiles = num_m_tiles;
  plan.minibatch_tiles = minibatch_tiles;
  plan.gate_up_n_tiles = tiles_over(intermediate, kOrderGateUpColumns);
  plan.down_n_tiles = tiles_over(hidden, kOrderTileColumns);
  plan.combine_blocks = 0;
  plan.memory_tasks = 0;
  plan.shared_m_tiles = shared_m_tiles;
  if (shared_m_tiles > 0) {
    plan.shared_gate_up_n_tiles = tiles_over(shared_intermediate, kOrderGateUpColumns);
    plan.shared_down_n_tiles = tiles_over(hidden, kOrderTileColumns);
  }
  return plan;
}

constexpr int32_t kTileGroupM = 8;

// Tile `local` of a GEMM over m_tiles x n_tiles tiles, walked in groups of up to `group_size`
// row tiles swept n-major (row tiles fastest within a column), so CTAs running together read
// the same weight tile; a group of 1 walks each row tile's columns in turn.
MOK_HOST_DEVICE inline void grouped_tile_in(int32_t local, int32_t m_tiles, int32_t n_tiles,
                                            int32_t group_size, int32_t* m_tile, int32_t* n_tile) {
  const int32_t group = local / (group_size * n_tiles);
  const int32_t first_m = group * group_size;
  const int32_t group_m = m_tiles - first_m < group_size ? m_tiles - first_m : group_size;
  const int32_t in_group = local - group * group_size * n_tiles;
  *m_tile = first_m + in_group % group_m;
  *n_tile = in_group / group_m;
}

// The same in groups of kTileGroupM row tiles (about one expert): the persistent kernels' walk.
MOK_HOST_DEVICE inline void grouped_tile(int32_t local, int32_t m_tiles, int32_t n_tiles,
                                         int32_t* m_tile, int32_t* n_tile) {
  grouped_tile_in(local, m_tiles, n_tiles, kTileGroupM, m_tile, n_tile);
}

MOK_HOST_DEVICE inline int32_t num_minibatches(const ForwardPlan& plan) {
  return (plan.num_m_tiles + plan.minibatch_tiles - 1) / plan.minibatch_tiles;
}

MOK_HOST_DEVICE inline int32_t minibatch_first_tile(const ForwardPlan& plan, int32_t b) {
  return b * plan.minibatch_tiles;
}

MOK_HOST_DEVICE inline int32_t minibatch_tiles(const ForwardPlan& plan, int32_t b) {
  const int32_t first = minibatch_first_tile(plan, b);
  const int32_t rest = plan.num_m_tiles - first;
  return rest < plan.minibatch_tiles ? rest : plan.minibatch_tiles;
}

// The segments of the order: segment s is (kind, minibatch). Segment 0 is gather(0), 1 is
// gate_up(0); then four per minibatch b >= 0: gather(b+1), gate_up(b+1), down(b), push(b) (the
// gather and gate_up of a minibatch past the last are empty, and so is every push without
// expert parallelism); then the shared expert's gate/up and down segments (empty without one);
// then one combine segment.
constexpr int32_t kSegmentsPerMinibatch = 4;
MOK_HOST_DEVICE inline int32_t num_segments(const ForwardPlan& plan) {
  return 2 + kSegmentsPerMinibatch * num_minibatches(plan) + 2 + 1;
}

MOK_HOST_DEVICE inline bool has_pushes(const ForwardPlan& plan) {
  return plan.num_ranks > 1 && plan.memory_tasks != 0;
}

MOK_HOST_DEVICE inline void segment_at(const ForwardPlan& plan, int32_t segment, TaskKind* kind,
                                       int32_t* minibatch) {
  const int32_t batches = num_minibatches(plan);
  const int32_t routed_end = 2 + kSegmentsPerMinibatch * batches;
  if (segment < 2) {
    *kind = segment == 0 ? TaskKind::kGather : TaskKind::kGateUp;
    *minibatch = 0;
  } else if (segment < routed_end) {
    const int32_t b = (segment - 2) / kSegmentsPerMinibatch;
    const int32_t which = (segment - 2) % kSegmentsPerMinibatch;
    constexpr TaskKind kKinds[kSegmentsPerMinibatch] = {TaskKind::kGather, TaskKind::kGateUp,
                                                        TaskKind::kDown, TaskKind::kPush};
    *kind = kKinds[which];
    *minibatch = which < 2 ? b + 1 : b;
  } else if (segment < routed_end + 2) {
    *kind = segment == routed_end ? TaskKind::kSharedGateUp : TaskKind::kSharedDown;
    *minibatch = -1;
  } else {
    *kind = TaskKind::kCombine;
    *minibatch = -1;
  }
}

MOK_HOST_DEVICE inline int64_t segment_size(const ForwardPlan& plan, TaskKind kind, int32_t b) {
  if ((kind == TaskKind::kCombine || kind == TaskKind::kGather) && plan.memory_tasks == 0) return 0;
  if (kind == TaskKind::kPush && !has_pushes(plan)) return 0;
  if (kind == TaskKind::kCombine) return plan.combine_blocks;
  if (kind == TaskKind::kSharedGateUp)
    return static_cast<int64_t>(plan.shared_m_tiles) * plan.shared_gate_up_n_tiles;
  if (kind == TaskKind::kSharedDown)
    return static_cast<int64_t>(plan.shared_m_tiles) * plan.shared_down_n_tiles;
  if (b >= num_minibatches(plan)) return 0;
  const int64_t tiles = minibatch_tiles(plan, b);
  if (kind == TaskKind::kGather || kind == TaskKind::kPush) return tiles;
  return tiles * (kind == TaskKind::kGateUp ? plan.gate_up_n_tiles : plan.down_n_tiles);
}

MOK_HOST_DEVICE inline int64_t segment_length(const ForwardPlan& plan, int32_t segment) {
  TaskKind kind;
  int32_t b;
  segment_at(plan, segment, &kind, &b);
  return segment_size(plan, kind, b);
}

// The walk over a plan's segments, shared by this order and the backward's
// (backward_task_order.h): a plan type provides num_segments(plan) and segment_length(plan, s).
template <typename Plan>
MOK_HOST_DEVICE inline int64_t num_tasks(const Plan& plan) {
  int64_t total = 0;
  for (int32_t s = 0; s < num_segments(plan); ++s) total += segment_length(plan, s);
  return total;
}

// Where a walk over the segments stands: segment `segment` starts at ticket `first_ticket`.
// A caller whose tickets only grow (a persistent CTA's scheduler) keeps one and never rewalks;
// it also keeps what is costly to recompute per ticket (the segment's length, and a value the
// plan's decoder caches: the backward's first expert of a weight-gradient segment), since the
// scheduler thread decodes every task on the path to its loads (traced: ~4 us per weight-
// gradient task when recomputed each time, docs/perf.md).
struct SegmentCursor {
  int32_t segment = 0;
  int64_t first_ticket = 0;
  int64_t length = -1;  // of `segment`; -1 until computed
  int32_t base = -1;    // the decoder's cached value for `segment`; -1 until computed
  // A merged order's (backward_task_order.h, BackwardPlans): `segment`'s plan and its segment
  // there, cached with `base`.
  int32_t set = 0;
  int32_t plan_segment = 0;
};

// Moves the cursor forward to the segment holding `ticket` (not below the cursor's first
// ticket): O(segments skipped). False when the ticket is past the last task.
template <typename Plan>
MOK_HOST_DEVICE inline bool seek_segment(const Plan& plan, int64_t ticket, SegmentCursor* cursor) {
  for (;;) {
    if (cursor->length < 0) {
      if (cursor->segment >= num_segments(plan)) return false;
      cursor->length = segment_length(plan, cursor->segment);
      cursor->base = -1;
    }
    if (ticket < cursor->first_ticket + cursor->length) return true;
    cursor->first_ticket += cursor->length;
    ++cursor->segment;
    cursor->length = -1;
  }
}

// The task at offset `local` of segment `segment`.
MOK_HOST_DEVICE inline Task task_in_segment(const ForwardPlan& plan, int32_t segment,
                                            int64_t local_ticket) {
  TaskKind kind;
  int32_t b;
  segment_at(plan, segment, &kind, &b);
  Task task{kind, b, -1, -1, -1};
  if (kind == TaskKind::kCombine) {
    task.block = static_cast<int32_t>(local_ticket);
  } else if (kind == TaskKind::kGather || kind == TaskKind::kPush) {
    task.m_tile = minibatch_first_tile(plan, b) + static_cast<int32_t>(local_ticket);
  } else if (is_shared(kind)) {
    grouped_tile(
        static_cast<int32_t>(local_ticket), plan.shared_m_tiles,
        kind == TaskKind::kSharedGateUp ? plan.shared_gate_up_n_tiles : plan.shared_down_n_tiles,
        &task.m_tile, &task.n_tile);
  } else {
    const int32_t n_tiles = kind == TaskKind::kGateUp ? plan.gate_up_n_tiles : plan.down_n_tiles;
    grouped_tile(static_cast<int32_t>(local_ticket), minibatch_tiles(plan, b), n_tiles,
                 &task.m_tile, &task.n_tile);
    task.m_tile += minibatch_first_tile(plan, b);
  }
  return task;
}

// The task of `ticket` (0 <= ticket < num_tasks, and not below the cursor's first ticket),
// moving the cursor forward to the ticket's segment.
MOK_HOST_DEVICE inline Task task_at(const ForwardPlan& plan, int64_t ticket,
                                    SegmentCursor* cursor) {
  if (!seek_segment(plan, ticket, cursor))
    return Task{TaskKind::kCombine, -1, -1, -1, -1};  // past the end: callers stop before
  return task_in_segment(plan, cursor->segment, ticket - cursor->first_ticket);
}

// The task of `ticket` (0 <= ticket < num_tasks). Walks the segments: O(minibatches).
MOK_HOST_DEVICE inline Task task_at(const ForwardPlan& plan, int64_t ticket) {
  SegmentCursor cursor;
  return task_at(plan, ticket, &cursor);
}

MOK_HOST_DEVICE inline Dependency dependency_of(const ForwardPlan& plan, const Task& task) {
  switch (task.kind) {
    case TaskKind::kGather:
      return {CounterKind::kNone, 0, 0};
    case TaskKind::kGateUp:
      if (plan.memory_tasks == 0) return {CounterKind::kNone, 0, 0};
      return {CounterKind::kRowsGathered, task.m_tile, 1};
    case TaskKind::kDown:
      return {CounterKind::kGateUpDone, task.m_tile, plan.gate_up_n_tiles};
    case TaskKind::kSharedGateUp:
      return {CounterKind::kNone, 0, 0};
    case TaskKind::kSharedDown:
      return {CounterKind::kSharedGateUpDone, task.m_tile, plan.shared_gate_up_n_tiles};
    case TaskKind::kPush:
      return {CounterKind::kRowDownDone, task.m_tile, plan.down_n_tiles};
    case TaskKind::kCombine:
      // Every down tile here: the routed rows of this rank's own tokens are read in place.
      return {CounterKind::kDownDone, 0,
              static_cast<int64_t>(plan.num_m_tiles) * plan.down_n_tiles +
                  static_cast<int64_t>(plan.shared_m_tiles) * plan.shared_down_n_tiles};
  }
  return {CounterKind::kNone, 0, 0};
}

// The wait on other ranks, after dependency_of's (kNone but for a combine under expert
// parallelism): the rows the other ranks push into its block.
MOK_HOST_DEVICE inline Dependency remote_dependency_of(const ForwardPlan& plan, const Task& task) {
  if (task.kind == TaskKind::kCombine && has_pushes(plan))
    return {CounterKind::kRowsPushed, task.block, kTargetFromRouting};
  return {CounterKind::kNone, 0, 0};
}

}  // namespace mok::kernels
