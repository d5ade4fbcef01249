// The task kinds of the persistent backward kernel (backward_gemms.cu), one struct per kind, each
// holding everything the kernel does for that kind (the order and the dependency targets are
// backward_task_order.h's, shared with the host):
//   describe(set, plan, task, queued)    what the consumers need: the expert, the K blocks
//   wait_for_inputs(scope, set, queued)  its dependency, waited for by the scheduler thread
//   stage_bytes(set, k_block)            the bytes of one ring stage of its loads
//   load_stage(maps, set, queued, coord, k_block, ...)  the TMA loads of that stage
//   run(scope, set, maps, queued, acc)   the consumers' compute, epilogue and the counters it
//                                        signals
// visit_backward_task is the one place that maps a BackwardTaskKind to its struct: a new kind (the
// communication and combine tasks to come) is a struct here and one line there. The kernel's warp
// roles call each function through it, so each kind's code is compiled on its own path (a task's
// K-block loop holds no switch).
//
// Dependencies (counters in global memory, epoch * kGateUpDoneStride + count), signalled by run:
//   recompute(m, n), down_dgrad(m, n)  rows gathered (the spare warps: wait_for_gathered_tile)
//                                      signal row_gemms_done[m]
//   swiglu(m)                          waits row_gemms_done[m]; signals swiglu_done[m] and
//                                      expert_ready[its expert]
//   gate_up_dgrad(m, n)                waits swiglu_done[m]
//   wgrad(e, matrix, t)                waits expert_ready[e] (none for an empty expert)
// Ordering: a GEMM tile's output leaves by TMA stores; the issuing consumer thread waits for them
// to complete, fences the async proxy and release-adds the counter (count_stored_tile); the
// scheduler acquires and fences the async proxy before its TMA loads (acquire_for_tma). The
// SwiGLU task's generic stores: each thread fences (device scope, and toward the async proxy),
// the eight consumer warps meet at a named barrier, then one thread release-adds.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_loads.cuh"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/persistent/backward_task_order.h"
#include "kernels/persistent/launch.h"
#include "kernels/persistent/swiglu_backward_task.cuh"
#include "kernels/persistent/task_queue.cuh"
#include "kernels/stages/dispatch_local.cuh"

namespace mok::kernels {

static_assert(kOrderTileRows == BLOCK_M && kOrderTileColumns == BLOCK_N,
              "the task order counts the GEMM's tiles");

// The named barrier of the SwiGLU task's consumer warps (1: the consumers' staging tile).
constexpr int kSwigluBarrier = 2;

// A task as the consumers need it.
struct BackwardQueuedTask {
  int32_t kind;  // BackwardTaskKind, or kStopTask
  int32_t set;   // 0 the routed experts, 1 the shared expert
  int32_t m_tile;
  int32_t n_tile;
  int32_t expert;  // the row tile's expert, or the weight gradient's
  int32_t matrix;  // wgrad: 0 gate, 1 up, 2 down
  int32_t k_row0;  // wgrad: the expert's first row
  int32_t num_k_blocks;
  int32_t ticket;  // for the task trace
};

using BackwardStorage = GemmSharedStorage<kNumStages>;

// What the scheduler thread holds while it waits for a task's inputs.
struct BackwardSchedulerScope {
  const WaitContext& wait;
  const BackwardPlans& plans;      // expert_tiles in shared memory
  unsigned long long epoch;        // this launch's
  unsigned long long d_out_epoch;  // the routed rows' gathers (0: none)
  unsigned long long x_epoch;
  // The expert (set * 2^16 + expert) whose SwiGLU tasks this thread last saw finished: its next
  // weight-gradient tiles (an expert has hundreds, several per CTA in a row) need no second
  // look at the counter.
  int32_t ready_expert;
};

__device__ __forceinline__ TileCoord coord_of(const BackwardQueuedTask& task) {
  TileCoord coord;
  coord.expert = task.expert;
  coord.m_tile = task.m_tile;
  coord.n_tile = task.n_tile;
  coord.k_row0 = task.k_row0;
  coord.num_k_blocks = task.num_k_blocks;
  return coord;
}

// The row-tile tasks' common description: the expert of the row tile, `k_extent` / BLOCK_K.
__device__ __forceinline__ void describe_row_tile(const BackwardPlan& plan,
                                                  const BackwardTask& task, int32_t k_blocks,
                                                  BackwardQueuedTask& queued) {
  queued.expert = expert_of_tile(plan, task.m_tile);
  queued.num_k_blocks = k_blocks;
}

// The dependency target of `queued` in the task order (backward_task_order.h's dependency_of).
__device__ __forceinline__ int64_t dependency_target(const BackwardPlan& plan,
                                                     const BackwardQueuedTask& queued) {
  const BackwardTask task{static_cast<BackwardTaskKind>(queued.kind),
                          queued.set,
                          -1,
                          queued.m_tile,
                          queued.n_tile,
                          queued.expert,
                          queued.matrix,
                          -1};
  return dependency_of(plan, task).target;
}

// A GEMM tile's ring stage: one K-block of A and B.
struct GemmTileStages {
  __device__ __forceinline__ static uint32_t stage_bytes(const BackwardSetParams&, int) {
    return kTileABytes + kTileBBytes;
  }
};

// recompute(m, n): g and u of a 128 x (128 gate + 128 up) tile again, from the gathered x rows
// (the backward without the forward context).
struct RecomputeTask : GemmTileStages {
  __device__ __forceinline__ static void describe(const BackwardSetParams& set,
                                                  const BackwardPlan& plan,
                                                  const BackwardTask& task,
                                                  BackwardQueuedTask& queued) {
    describe_row_tile(plan, task, set.recompute.k_extent / BLOCK_K, queued);
  }
  __device__ __forceinline__ static void wait_for_inputs(BackwardSchedulerScope& scope,
                                                         const BackwardSetParams& set,
                                                         const BackwardQueuedTask& queued) {
    if (set.x_gather.x != nullptr)
      wait_for_gathered_tile(scope.wait, set.x_gather, queued.m_tile, scope.x_epoch);
  }
  __device__ __forceinline__ static void load_stage(const BackwardSetMaps& maps,
                                                    const BackwardSetParams& set,
                                                    const BackwardQueuedTask&,
                                                    const TileCoord& coord, int k_block,
                                                    __nv_bfloat16* a_dst, __nv_bfloat16* b_dst,
                                                    uint64_t* full) {
    issue_loads<ExpertGemmForm::kGateUpStore>(&maps.x_rows, &maps.x_rows, &maps.w_gate, &maps.w_up,
                                              set.recompute, coord, k_block, a_dst, b_dst, full);
  }
  __device__ __forceinline__ static void run(TaskConsumerScope& scope, const BackwardSetParams& set,
                                             const BackwardSetMaps& maps,
                                             const BackwardQueuedTask& task, float (&acc)[128]) {
    consume_tile<false, false>(scope.wait, scope.smem, scope.state, task.num_k_blocks,
                               scope.consumer_idx, acc);
    store_tile<ExpertGemmForm::kGateUpStore>({&maps.gate_out, &maps.up_out, nullptr}, scope.smem,
                                             set.recompute, coord_of(task), scope.consumer_idx,
                                             acc);
    if (scope.issuer) count_stored_tile(set.row_gemms_done + task.m_tile, scope.epoch);
  }
};

// down_dgrad(m, n): a 128 x 256 tile of dh_raw = d_out Wd.
struct DownDgradTask : GemmTileStages {
  __device__ __forceinline__ static void describe(const BackwardSetParams& set,
                                                  const BackwardPlan& plan,
                                                  const BackwardTask& task,
                                                  BackwardQueuedTask& queued) {
    describe_row_tile(plan, task, set.down_dgrad.k_extent / BLOCK_K, queued);
  }
  __device__ __forceinline__ static void wait_for_inputs(BackwardSchedulerScope& scope,
                                                         const BackwardSetParams& set,
                                                         const BackwardQueuedTask& queued) {
    if (set.d_out_gather.x != nullptr)
      wait_for_gathered_tile(scope.wait, set.d_out_gather, queued.m_tile, scope.d_out_epoch);
  }
  __device__ __forceinline__ static void load_stage(const BackwardSetMaps& maps,
                                                    const BackwardSetParams& set,
                                                    const BackwardQueuedTask&,
                                                    const TileCoord& coord, int k_block,
                                                    __nv_bfloat16* a_dst, __nv_bfloat16* b_dst,
                                                    uint64_t* full) {
    issue_loads<ExpertGemmForm::kDownGrad>(&maps.d_out_rows, &maps.d_out_rows, &maps.w_down_mn,
                                           &maps.w_down_mn, set.down_dgrad, coord, k_block, a_dst,
                                           b_dst, full);
  }
  __device__ __forceinline__ static void run(TaskConsumerScope& scope, const BackwardSetParams& set,
                                             const BackwardSetMaps& maps,
                                             const BackwardQueuedTask& task, float (&acc)[128]) {
    consume_tile<false, true>(scope.wait, scope.smem, scope.state, task.num_k_blocks,
                              scope.consumer_idx, acc);
    store_tile<ExpertGemmForm::kDownGrad>({&maps.dh_out, nullptr, nullptr}, scope.smem,
                                          set.down_dgrad, coord_of(task), scope.consumer_idx, acc);
    if (scope.issuer) count_stored_tile(set.row_gemms_done + task.m_tile, scope.epoch);
  }
};

// swiglu(m): the SwiGLU backward of row tile m's 128 rows, streamed through the ring by the
// scheduler (swiglu_backward_task.cuh), run by the eight consumer warps: d_g, d_u, h_w in place of
// dh_raw, and the router-weight gradients of its pairs.
struct SwigluTask {
  __device__ __forceinline__ static void describe(const BackwardSetParams& set,
                                                  const BackwardPlan& plan,
                                                  const BackwardTask& task,
                                                  BackwardQueuedTask& queued) {
    describe_row_tile(plan, task, swiglu_task_stages(set.swiglu.vectors_per_row * 8), queued);
  }
  __device__ __forceinline__ static void wait_for_inputs(BackwardSchedulerScope& scope,
                                                         const BackwardSetParams& set,
                                                         const BackwardQueuedTask& queued) {
    wait_for_count(scope.wait, WaitSite::kRowGemmsDone, set.row_gemms_done + queued.m_tile,
                   scope.epoch, dependency_target(scope.plans.sets[queued.set], queued));
    acquire_for_tma();
  }
  __device__ __forceinline__ static uint32_t stage_bytes(const BackwardSetParams& set,
                                                         int k_block) {
    return swiglu_stage_bytes(set.swiglu.vectors_per_row * 8, k_block);
  }
  __device__ __forceinline__ static void load_stage(const BackwardSetMaps& maps,
                                                    const BackwardSetParams& set,
                                                    const BackwardQueuedTask&,
                                                    const TileCoord& coord, int k_block,
                                                    __nv_bfloat16* a_dst, __nv_bfloat16* b_dst,
                                                    uint64_t* full) {
    issue_swiglu_loads(&maps.swiglu_gate, &maps.swiglu_up, &maps.swiglu_dh,
                       set.swiglu.vectors_per_row * 8, coord.m_tile, 0, k_block, a_dst, b_dst,
                       full);
  }
  __device__ __forceinline__ static void run(TaskConsumerScope& scope, const BackwardSetParams& set,
                                             const BackwardSetMaps&, const BackwardQueuedTask& task,
                                             float (&)[128]) {
    run_swiglu_tile(scope.wait, scope.smem, scope.state, set.swiglu, task.m_tile,
                    set.down_dgrad.header->total_rows);
    // Device scope (system scope for router-weight gradients that went to other GPUs, read
    // after the push's signal), and toward the async proxy: the tiles that wait for this task
    // load d_g, d_u and h_w with TMA.
    if (set.swiglu.d_router_weights_peers != nullptr)
      __threadfence_system();
    else
      __threadfence();
    acquire_for_tma();
    ptx::named_barrier_sync(kSwigluBarrier, kConsumerThreads);
    if (scope.issuer) {
      count_done(set.swiglu_done + task.m_tile, scope.epoch);
      count_done(set.expert_ready + task.expert, scope.epoch);
    }
  }
};

// gate_up_dgrad(m, n): a 128 x 256 tile of the dx rows = d_g Wg + d_u Wu.
struct GateUpDgradTask : GemmTileStages {
  __device__ __forceinline__ static void describe(const BackwardSetParams& set,
                                                  const BackwardPlan& plan,
                                                  const BackwardTask& task,
                                                  BackwardQueuedTask& queued) {
    describe_row_tile(plan, task, 2 * set.gate_up_dgrad.k_extent / BLOCK_K, queued);
  }
  __device__ __forceinline__ static void wait_for_inputs(BackwardSchedulerScope& scope,
                                                         const BackwardSetParams& set,
                                                         const BackwardQueuedTask& queued) {
    wait_for_count(scope.wait, WaitSite::kSwigluDone, set.swiglu_done + queued.m_tile, scope.epoch,
                   dependency_target(scope.plans.sets[queued.set], queued));
    acquire_for_tma();
  }
  __device__ __forceinline__ static void load_stage(const BackwardSetMaps& maps,
                                                    const BackwardSetParams& set,
                                                    const BackwardQueuedTask&,
                                                    const TileCoord& coord, int k_block,
                                                    __nv_bfloat16* a_dst, __nv_bfloat16* b_dst,
                                                    uint64_t* full) {
    issue_loads<ExpertGemmForm::kGateUpGradStore>(&maps.d_gate, &maps.d_up, &maps.w_gate_mn,
                                                  &maps.w_up_mn, set.gate_up_dgrad, coord, k_block,
                                                  a_dst, b_dst, full);
  }
  __device__ __forceinline__ static void run(TaskConsumerScope& scope, const BackwardSetParams& set,
                                             const BackwardSetMaps& maps,
                                             const BackwardQueuedTask& task, float (&acc)[128]) {
    consume_tile<false, true>(scope.wait, scope.smem, scope.state, task.num_k_blocks,
                              scope.consumer_idx, acc);
    store_tile<ExpertGemmForm::kGateUpGradStore>({&maps.dx_out, nullptr, nullptr}, scope.smem,
                                                 set.gate_up_dgrad, coord_of(task),
                                                 scope.consumer_idx, acc);
  }
};

// wgrad(e, matrix, t): tile t of expert e's gate (matrix 0), up (1) or down (2) weight gradient,
// K = the expert's rows, in the standalone kernel's tile walk.
struct WeightGradTask : GemmTileStages {
  __device__ __forceinline__ static void describe(const BackwardSetParams& set,
                                                  const BackwardPlan& plan,
                                                  const BackwardTask& task,
                                                  BackwardQueuedTask& queued) {
    // From shared memory only (the plan's expert_tiles): a global load here would sit between
    // two tasks' loads on the scheduler's critical path.
    const ExpertGemmParams& wgrad = task.matrix == 2 ? set.wgrad_down : set.wgrad_gate_up;
    const int num_m_tiles = (wgrad.m_extent + BLOCK_M - 1) / BLOCK_M;
    queued.expert = task.expert;
    queued.matrix = task.matrix;
    queued.n_tile = task.m_tile / num_m_tiles;
    queued.m_tile = task.m_tile % num_m_tiles;
    const int32_t first_tile = plan.expert_tiles[task.expert];
    queued.k_row0 = first_tile * BLOCK_M;
    queued.num_k_blocks = (plan.expert_tiles[task.expert + 1] - first_tile) * (BLOCK_M / BLOCK_K);
  }
  __device__ __forceinline__ static void wait_for_inputs(BackwardSchedulerScope& scope,
                                                         const BackwardSetParams& set,
                                                         const BackwardQueuedTask& queued) {
    const int32_t expert_key = (queued.set << 16) + queued.expert;
    if (expert_key == scope.ready_expert) return;
    const int64_t tiles = dependency_target(scope.plans.sets[queued.set], queued);
    if (tiles > 0) {
      wait_for_count(scope.wait, WaitSite::kExpertReady, set.expert_ready + queued.expert,
                     scope.epoch, tiles);
      acquire_for_tma();
    }
    scope.ready_expert = expert_key;
  }
  __device__ __forceinline__ static void load_stage(const BackwardSetMaps& maps,
                                                    const BackwardSetParams& set,
                                                    const BackwardQueuedTask& queued,
                                                    const TileCoord& coord, int k_block,
                                                    __nv_bfloat16* a_dst, __nv_bfloat16* b_dst,
                                                    uint64_t* full) {
    const CUtensorMap* a = queued.matrix == 0   ? &maps.d_gate_mn
                           : queued.matrix == 1 ? &maps.d_up_mn
                                                : &maps.d_out_mn;
    const CUtensorMap* b = queued.matrix == 2 ? &maps.h_w_mn : &maps.x_mn;
    issue_loads<ExpertGemmForm::kWeightGrad>(a, a, b, b, set.wgrad_gate_up, coord, k_block, a_dst,
                                             b_dst, full);
  }
  __device__ __forceinline__ static void run(TaskConsumerScope& scope, const BackwardSetParams& set,
                                             const BackwardSetMaps& maps,
                                             const BackwardQueuedTask& task, float (&acc)[128]) {
    consume_tile<true, true>(scope.wait, scope.smem, scope.state, task.num_k_blocks,
                             scope.consumer_idx, acc);
    const CUtensorMap* out = task.matrix == 0   ? &maps.d_w_gate
                             : task.matrix == 1 ? &maps.d_w_up
                                                : &maps.d_w_down;
    store_tile<ExpertGemmForm::kWeightGrad>({out, nullptr, nullptr}, scope.smem,
                                            task.matrix == 2 ? set.wgrad_down : set.wgrad_gate_up,
                                            coord_of(task), scope.consumer_idx, acc);
  }
};

// Calls `visitor` with the struct of `kind` (a value of it: the functions are static). kRows and
// kCombine are never queued: the rows are gathered by the spare warps or before the launch, the
// combine runs after it.
template <typename Visitor>
__device__ __forceinline__ void visit_backward_task(BackwardTaskKind kind, Visitor&& visitor) {
  switch (kind) {
    case BackwardTaskKind::kRecompute:
      visitor(RecomputeTask{});
      return;
    case BackwardTaskKind::kDownDgrad:
      visitor(DownDgradTask{});
      return;
    case BackwardTaskKind::kSwiglu:
      visitor(SwigluTask{});
      return;
    case BackwardTaskKind::kGateUpDgrad:
      visitor(GateUpDgradTask{});
      return;
    default:  // kWeightGrad
      visitor(WeightGradTask{});
      return;
  }
}

}  // namespace mok::kernels
