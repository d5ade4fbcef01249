// The order of work of the persistent backward kernel (DESIGN.md §2.5, §2.7), as plain arithmetic
// that host and device share, like the forward's task_order.h: ticket t of a launch names one
// task, and every task waits only on tasks with smaller tickets, so the kernel progresses with
// any number of resident CTAs. backward_gemms.cu runs it (MoeConfig::persistent_backward); the
// CPU test checks the order and the dependencies.
//
// Tasks, per minibatch b of `minibatch_tiles` 128-row tiles (the last one may be short):
//   rows(m)              gather the d_out rows of row tile m (and its x rows when the
//                        backward recomputes the forward)                       (memory-bound)
//   recompute(m, n)      128 x (128 gate + 128 up) tile: bf16 g, u again        waits: rows(m)
//                        (only without the forward context)
//   down_dgrad(m, n)     128 x 256 tile of dh_raw = d_out Wd                    waits: rows(m)
//   swiglu(m)            SwiGLU backward of row tile m: d_g, d_u, h_w, and the router-weight
//                        gradients of its pairs                   waits: every GEMM tile of m
//   gate_up_dgrad(m, n)  128 x 256 tile of the dx rows                         waits: swiglu(m)
//   wgrad(e, matrix, t)  tile t of expert e's gate, up or down weight gradient (K = the expert's
//                        rows, one CTA per tile, fixed order)   waits: swiglu of every tile of e
//   combine(k)           the fixed-order d_x sum of token block k     waits: every dx tile
// Order (a software pipeline over minibatches, two steps deep: the GEMM tiles of b+1 run before
// the SwiGLU backward of b, which then rarely waits; the tiles that wait for the SwiGLU backward
// of b come one step later still, after that of b+1, so that a SwiGLU task, memory-bound on the
// warps of one SM, has a whole step to finish before its readers look for it; the weight
// gradients of an expert come in the step after the minibatch where its rows end):
//   rows(0) recompute(0) down_dgrad(0) |
//   rows(b+1) recompute(b+1) down_dgrad(b+1) swiglu(b) gate_up_dgrad(b-1) wgrad(b-1) | ... |
//   gate_up_dgrad(last) wgrad(last) | combine(*)
// (One step deep, gate_up_dgrad(b) right after swiglu(b): the kernel's backward took 4.55 ms at
// qwen3 with 16 minibatches against 2.91 with one, most CTAs waiting for the 32 SwiGLU tasks
// queued just before; two steps deep ~3.6 ms, and 3.0 once the SwiGLU task streamed its rows
// with TMA; docs/perf.md, session 6.)
// An expert ends in minibatch b when its last row tile is in b; an expert without rows goes
// where its (empty) segment sits, clamped to the last minibatch, so its zero gradient is still
// written once; with no row tiles at all, every expert's wgrad tasks form one segment before the
// combine. The experts of one minibatch are contiguous (segments are in expert order), so a
// binary search over the segment ends finds them: nothing is stored.
//
// The shared expert (BackwardPlans, set 1): the same tasks on its own plan (every token, one
// expert, one minibatch), its segments merged into the routed order so that its tasks fill the
// routed pipeline's gaps instead of forming a tail:
//   shared rows/recompute/down_dgrad | routed rows/recompute/down_dgrad(0) | shared swiglu |
//   routed step 0 | shared gate_up_dgrad, wgrad | the rest of the routed order
// Each set has its own counters; a task waits only on tasks of its own set with smaller tickets.
#pragma once

#include <stdint.h>

#include "kernels/persistent/task_order.h"
#include "mok/dtype.h"

namespace mok::kernels {

enum class BackwardTaskKind : int32_t {
  kRows = 0,
  kRecompute = 1,
  kDownDgrad = 2,
  kSwiglu = 3,
  kGateUpDgrad = 4,
  kWeightGrad = 5,
  kCombine = 6,
};
constexpr int32_t kNumBackwardTaskKinds = 7;

struct BackwardPlan {
  int32_t num_m_tiles;            // 128-row tiles of the schedule (header.num_tiles)
  int32_t minibatch_tiles;        // MoeConfig::minibatch_size / 128
  int32_t recompute;              // 1: no forward context, recompute g and u
  int32_t gate_up_n_tiles;        // ceil(I / 128): recompute tiles per row tile
  int32_t down_dgrad_n_tiles;     // ceil(I / 256)
  int32_t gate_up_dgrad_n_tiles;  // ceil(H / 256)
  int32_t gate_wgrad_tiles;       // ceil(I / 128) * ceil(H / 256): gate (and up) weight tiles
  int32_t down_wgrad_tiles;       // ceil(H / 128) * ceil(I / 256)
  int32_t num_experts;            // E_loc
  int32_t combine_blocks;         // token blocks of the d_x sum
  const int32_t* expert_tiles;    // [E_loc + 1]: expert e's row tiles are
                                  // [expert_tiles[e], expert_tiles[e + 1]) (expert_offsets / 128)
};

// The plan of one expert set over num_m_tiles row tiles of I = `intermediate`, H = `hidden`, E_loc
// = num_experts (expert_tiles as above; recompute: no forward context). The kernel and the host
// (the task trace's capacity) build it here.
MOK_HOST_DEVICE inline BackwardPlan backward_plan(int32_t num_m_tiles, int32_t minibatch_tiles,
                                                  bool recompute, int64_t intermediate,
                                                  int64_t hidden, int32_t num_experts,
                                                  const int32_t* expert_tiles) {
  BackwardPlan plan;
  plan.num_m_tiles = num_m_tiles;
  plan.minibatch_tiles = minibatch_tiles;
  plan.recompute = recompute ? 1 : 0;
  plan.gate_up_n_tiles = tiles_over(intermediate, kOrderGateUpColumns);
  plan.down_dgrad_n_tiles = tiles_over(intermediate, kOrderTileColumns);
  plan.gate_up_dgrad_n_tiles = tiles_over(hidden, kOrderTileColumns);
  plan.gate_wgrad_tiles =
      tiles_over(intermediate, kOrderTileRows) * tiles_over(hidden, kOrderTileColumns);
  plan.down_wgrad_tiles =
      tiles_over(hidden, kOrderTileRows) * tiles_over(intermediate, kOrderTileColumns);
  plan.num_experts = num_experts;
  plan.combine_blocks = 0;
  plan.expert_tiles = expert_tiles;
  return plan;
}

struct BackwardTask {
  BackwardTaskKind kind;
  int32_t set;        // 0 the routed experts, 1 the shared expert (BackwardPlans)
  int32_t minibatch;  // -1 for combine and for the no-rows wgrad segment
  int32_t m_tile;     // row tile (rows .. gate_up_dgrad), or the weight tile's M tile index
  int32_t n_tile;     // column tile, -1 where none
  int32_t expert;     // wgrad, -1 otherwise
  int32_t matrix;     // wgrad: 0 gate, 1 up, 2 down; -1 otherwise
  int32_t block;      // combine block, -1 otherwise
};

// What a task waits for: a counter reaching a target (producers release-add 1 when done).
enum class BackwardCounter : int32_t {
  kNone = 0,
  kRowsReady = 1,     // per row tile: rows(m)
  kRowGemmsDone = 2,  // per row tile: recompute(m, *) and down_dgrad(m, *)
  kSwigluDone = 3,    // per row tile: swiglu(m)
  kExpertReady = 4,   // per expert: swiglu(m) of each of its row tiles
  kDxDone = 5,        // one: every gate_up_dgrad tile
};
struct BackwardDependency {
  BackwardCounter counter;
  int32_t index;
  int64_t target;
};

MOK_HOST_DEVICE inline int32_t num_minibatches(const BackwardPlan& plan) {
  return (plan.num_m_tiles + plan.minibatch_tiles - 1) / plan.minibatch_tiles;
}

MOK_HOST_DEVICE inline int32_t minibatch_tiles(const BackwardPlan& plan, int32_t b) {
  const int32_t rest = plan.num_m_tiles - b * plan.minibatch_tiles;
  return rest < plan.minibatch_tiles ? rest : plan.minibatch_tiles;
}

// The minibatch whose segment holds expert e's weight-gradient tasks (see the map above).
MOK_HOST_DEVICE inline int32_t wgrad_minibatch(const BackwardPlan& plan, int32_t e) {
  const int32_t batches = num_minibatches(plan);
  const int32_t begin = plan.expert_tiles[e], end = plan.expert_tiles[e + 1];
  const int32_t tile = end > begin ? end - 1 : end;
  const int32_t b = tile / plan.minibatch_tiles;
  return b < batches ? b : batches - 1;
}

// Experts [0, result) have their weight gradients in minibatches <= b (wgrad_minibatch never
// decreases with e).
MOK_HOST_DEVICE inline int32_t experts_through(const BackwardPlan& plan, int32_t b) {
  int32_t low = 0, high = plan.num_experts;
  while (low < high) {
    const int32_t mid = (low + high) / 2;
    if (wgrad_minibatch(plan, mid) <= b)
      low = mid + 1;
    else
      high = mid;
  }
  return low;
}

MOK_HOST_DEVICE inline int64_t wgrad_tiles_per_expert(const BackwardPlan& plan) {
  return 2 * static_cast<int64_t>(plan.gate_wgrad_tiles) + plan.down_wgrad_tiles;
}

// Segments: 0-2 are rows(0), recompute(0), down_dgrad(0); then six per step b: rows(b+1),
// recompute(b+1), down_dgrad(b+1), swiglu(b), gate_up_dgrad(b-1), wgrad(b-1); then
// gate_up_dgrad and wgrad of the last minibatch; then the wgrad segment of a plan without row
// tiles (empty otherwise), then combine. A slot whose minibatch does not exist (b-1 < 0, or no
// minibatches at all) holds kNoMinibatch and is empty.
constexpr int32_t kNoMinibatch = -2;

MOK_HOST_DEVICE inline int32_t num_segments(const BackwardPlan& plan) {
  return 3 + 6 * num_minibatches(plan) + 4;
}

MOK_HOST_DEVICE inline void segment_at(const BackwardPlan& plan, int32_t segment,
                                       BackwardTaskKind* kind, int32_t* minibatch) {
  const int32_t batches = num_minibatches(plan);
  if (segment < 3) {
    *kind = static_cast<BackwardTaskKind>(segment);  // rows, recompute, down_dgrad
    *minibatch = 0;
  } else if (segment < 3 + 6 * batches) {
    const int32_t b = (segment - 3) / 6, which = (segment - 3) % 6;
    // rows, recompute, down_dgrad of b + 1, swiglu of b, then gate_up_dgrad, wgrad of b - 1.
    *kind = static_cast<BackwardTaskKind>(which);
    *minibatch = which < 3 ? b + 1 : which == 3 ? b : (b >= 1 ? b - 1 : kNoMinibatch);
  } else if (segment < 3 + 6 * batches + 2) {  // the last minibatch's readers of its SwiGLU
    *kind =
        segment == 3 + 6 * batches ? BackwardTaskKind::kGateUpDgrad : BackwardTaskKind::kWeightGrad;
    *minibatch = batches >= 1 ? batches - 1 : kNoMinibatch;
  } else if (segment == 3 + 6 * batches + 2) {
    *kind = BackwardTaskKind::kWeightGrad;
    *minibatch = -1;
  } else {
    *kind = BackwardTaskKind::kCombine;
    *minibatch = -1;
  }
}

MOK_HOST_DEVICE inline int64_t segment_size(const BackwardPlan& plan, BackwardTaskKind kind,
                                            int32_t b) {
  const int32_t batches = num_minibatches(plan);
  if (b == kNoMinibatch) return 0;
  switch (kind) {
    case BackwardTaskKind::kCombine:
      return plan.combine_blocks;
    case BackwardTaskKind::kWeightGrad: {
      if (b < 0) return batches == 0 ? plan.num_experts * wgrad_tiles_per_expert(plan) : 0;
      const int32_t first = b == 0 ? 0 : experts_through(plan, b - 1);
      return static_cast<int64_t>(experts_through(plan, b) - first) * wgrad_tiles_per_expert(plan);
    }
    default:
      break;
  }
  if (b >= batches) return 0;
  const int64_t tiles = minibatch_tiles(plan, b);
  switch (kind) {
    case BackwardTaskKind::kRows:
    case BackwardTaskKind::kSwiglu:
      return tiles;
    case BackwardTaskKind::kRecompute:
      return plan.recompute != 0 ? tiles * plan.gate_up_n_tiles : 0;
    case BackwardTaskKind::kDownDgrad:
      return tiles * plan.down_dgrad_n_tiles;
    default:  // kGateUpDgrad
      return tiles * plan.gate_up_dgrad_n_tiles;
  }
}

MOK_HOST_DEVICE inline int64_t segment_length(const BackwardPlan& plan, int32_t segment) {
  BackwardTaskKind kind;
  int32_t b;
  segment_at(plan, segment, &kind, &b);
  return segment_size(plan, kind, b);
}

// The first expert of the weight-gradient segment of minibatch b (b < 0: the no-rows segment).
MOK_HOST_DEVICE inline int32_t wgrad_first_expert(const BackwardPlan& plan, int32_t b) {
  return b <= 0 ? 0 : experts_through(plan, b - 1);
}

// The task at offset `local` of segment `segment` (a segment holds fewer than 2^31 tasks);
// `first_expert`: wgrad_first_expert of the segment's minibatch if known, else -1.
MOK_HOST_DEVICE inline BackwardTask backward_task_in_segment(const BackwardPlan& plan,
                                                             int32_t segment, int64_t local_ticket,
                                                             int32_t first_expert = -1) {
  BackwardTaskKind kind;
  int32_t b;
  segment_at(plan, segment, &kind, &b);
  BackwardTask task{kind, 0, b, -1, -1, -1, -1, -1};
  const int32_t first_tile = b * plan.minibatch_tiles;
  const int32_t local = static_cast<int32_t>(local_ticket);
  switch (kind) {
    case BackwardTaskKind::kCombine:
      task.block = local;
      break;
    case BackwardTaskKind::kRows:
    case BackwardTaskKind::kSwiglu:
      task.m_tile = first_tile + local;
      break;
    case BackwardTaskKind::kWeightGrad: {
      if (first_expert < 0) first_expert = wgrad_first_expert(plan, b);
      const int32_t per_expert = static_cast<int32_t>(wgrad_tiles_per_expert(plan));
      task.expert = first_expert + local / per_expert;
      const int32_t within = local % per_expert;
      task.matrix = within < plan.gate_wgrad_tiles ? 0 : within < 2 * plan.gate_wgrad_tiles ? 1 : 2;
      task.m_tile = within - task.matrix * plan.gate_wgrad_tiles;  // the weight tile's index
      break;
    }
    default: {  // the row-tile GEMMs
      const int32_t n_tiles = kind == BackwardTaskKind::kRecompute   ? plan.gate_up_n_tiles
                              : kind == BackwardTaskKind::kDownDgrad ? plan.down_dgrad_n_tiles
                                                                     : plan.gate_up_dgrad_n_tiles;
      grouped_tile(local, minibatch_tiles(plan, b), n_tiles, &task.m_tile, &task.n_tile);
      task.m_tile += first_tile;
      break;
    }
  }
  return task;
}

// The task of `ticket` (0 <= ticket < num_tasks, not below the cursor's first ticket), moving
// the cursor forward (seek_segment, task_order.h).
MOK_HOST_DEVICE inline BackwardTask backward_task_at(const BackwardPlan& plan, int64_t ticket,
                                                     SegmentCursor* cursor) {
  if (!seek_segment(plan, ticket, cursor))
    return BackwardTask{BackwardTaskKind::kCombine, 0, -1, -1, -1, -1, -1, -1};
  if (cursor->base < 0) {  // once per segment: the weight gradients' first expert
    BackwardTaskKind kind;
    int32_t b;
    segment_at(plan, cursor->segment, &kind, &b);
    cursor->base = kind == BackwardTaskKind::kWeightGrad ? wgrad_first_expert(plan, b) : 0;
  }
  return backward_task_in_segment(plan, cursor->segment, ticket - cursor->first_ticket,
                                  cursor->base);
}

MOK_HOST_DEVICE inline BackwardTask backward_task_at(const BackwardPlan& plan, int64_t ticket) {
  SegmentCursor cursor;
  return backward_task_at(plan, ticket, &cursor);
}

// The expert of row tile m: the one whose tile range holds it (binary search).
MOK_HOST_DEVICE inline int32_t expert_of_tile(const BackwardPlan& plan, int32_t m_tile) {
  int32_t low = 0, high = plan.num_experts;  // first e with expert_tiles[e + 1] > m_tile
  while (low < high) {
    const int32_t mid = (low + high) / 2;
    if (plan.expert_tiles[mid + 1] <= m_tile)
      low = mid + 1;
    else
      high = mid;
  }
  return low;
}

MOK_HOST_DEVICE inline BackwardDependency dependency_of(const BackwardPlan& plan,
                                                        const BackwardTask& task) {
  switch (task.kind) {
    case BackwardTaskKind::kRecompute:
    case BackwardTaskKind::kDownDgrad:
      return {BackwardCounter::kRowsReady, task.m_tile, 1};
    case BackwardTaskKind::kSwiglu:
      return {BackwardCounter::kRowGemmsDone, task.m_tile,
              plan.down_dgrad_n_tiles + (plan.recompute != 0 ? plan.gate_up_n_tiles : 0)};
    case BackwardTaskKind::kGateUpDgrad:
      return {BackwardCounter::kSwigluDone, task.m_tile, 1};
    case BackwardTaskKind::kWeightGrad: {
      const int32_t tiles = plan.expert_tiles[task.expert + 1] - plan.expert_tiles[task.expert];
      if (tiles == 0) return {BackwardCounter::kNone, 0, 0};
      return {BackwardCounter::kExpertReady, task.expert, tiles};
    }
    case BackwardTaskKind::kCombine: {
      const int64_t dx_tiles = static_cast<int64_t>(plan.num_m_tiles) * plan.gate_up_dgrad_n_tiles;
      if (dx_tiles == 0) return {BackwardCounter::kNone, 0, 0};  // no rows: nothing to wait for
      return {BackwardCounter::kDxDone, 0, dx_tiles};
    }
    default:  // kRows
      return {BackwardCounter::kNone, 0, 0};
  }
}

// The routed experts' plan and, when num_sets == 2, the shared expert's (one minibatch: its
// minibatch_tiles >= its num_m_tiles >= 1), in one ticket stream (the merge at the top).
struct BackwardPlans {
  BackwardPlan sets[2];
  int32_t num_sets;  // 1: routed only; 2: with the shared expert
};

// The merged order's pieces: (set, first segment, end segment) of each plan, in ticket order.
MOK_HOST_DEVICE inline int32_t merged_pieces(const BackwardPlans& plans, int32_t piece_set[6],
                                             int32_t piece_begin[6], int32_t piece_end[6]) {
  const int32_t routed_segments = num_segments(plans.sets[0]);
  if (plans.num_sets < 2) {
    piece_set[0] = 0;
    piece_begin[0] = 0;
    piece_end[0] = routed_segments;
    return 1;
  }
  // Routed: head (rows/recompute/down_dgrad of minibatch 0), step 0 (six segments, when there is
  // a minibatch), the rest. Shared (one minibatch): head, step 0, its last four segments.
  const int32_t routed_step_end = 3 + (num_minibatches(plans.sets[0]) > 0 ? 6 : 0);
  const int32_t shared_segments = num_segments(plans.sets[1]);
  const int32_t sets[6] = {1, 0, 1, 0, 1, 0};
  const int32_t begins[6] = {0, 0, 3, 3, 9, routed_step_end};
  const int32_t ends[6] = {3, 3, 9, routed_step_end, shared_segments, routed_segments};
  for (int i = 0; i < 6; ++i) {
    piece_set[i] = sets[i];
    piece_begin[i] = begins[i];
    piece_end[i] = ends[i];
  }
  return 6;
}

MOK_HOST_DEVICE inline int32_t num_segments(const BackwardPlans& plans) {
  return num_segments(plans.sets[0]) + (plans.num_sets == 2 ? num_segments(plans.sets[1]) : 0);
}

// Merged segment `merged` -> the set and its segment in that set's plan.
MOK_HOST_DEVICE inline void merged_segment_at(const BackwardPlans& plans, int32_t merged,
                                              int32_t* set, int32_t* segment) {
  int32_t piece_set[6], piece_begin[6], piece_end[6];
  const int32_t pieces = merged_pieces(plans, piece_set, piece_begin, piece_end);
  for (int32_t i = 0; i < pieces; ++i) {
    const int32_t length = piece_end[i] - piece_begin[i];
    if (merged < length) {
      *set = piece_set[i];
      *segment = piece_begin[i] + merged;
      return;
    }
    merged -= length;
  }
  *set = 0;
  *segment = num_segments(plans.sets[0]);  // past the end
}

MOK_HOST_DEVICE inline int64_t segment_length(const BackwardPlans& plans, int32_t merged) {
  int32_t set, segment;
  merged_segment_at(plans, merged, &set, &segment);
  return segment_length(plans.sets[set], segment);
}

// The task of `ticket` in the merged order (not below the cursor's first ticket), moving the
// cursor forward; its `set` names the plan it belongs to.
MOK_HOST_DEVICE inline BackwardTask backward_task_at(const BackwardPlans& plans, int64_t ticket,
                                                     SegmentCursor* cursor) {
  if (!seek_segment(plans, ticket, cursor))
    return BackwardTask{BackwardTaskKind::kCombine, 0, -1, -1, -1, -1, -1, -1};
  if (cursor->base < 0) {  // once per segment: its plan, and the weight gradients' first expert
    merged_segment_at(plans, cursor->segment, &cursor->set, &cursor->plan_segment);
    const BackwardPlan& plan = plans.sets[cursor->set];
    BackwardTaskKind kind;
    int32_t b;
    segment_at(plan, cursor->plan_segment, &kind, &b);
    cursor->base = kind == BackwardTaskKind::kWeightGrad ? wgrad_first_expert(plan, b) : 0;
  }
  BackwardTask task = backward_task_in_segment(plans.sets[cursor->set], cursor->plan_segment,
                                               ticket - cursor->first_ticket, cursor->base);
  task.set = cursor->set;
  return task;
}

MOK_HOST_DEVICE inline BackwardTask backward_task_at(const BackwardPlans& plans, int64_t ticket) {
  SegmentCursor cursor;
  return backward_task_at(plans, ticket, &cursor);
}

}  // namespace mok::kernels
