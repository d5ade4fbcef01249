// The task kinds of the persistent forward GEMM kernel (forward_gemms.cu), one struct per kind,
// each holding everything the kernel does for that kind (the order and the dependency targets are
// task_order.h's, shared with the host), as backward_tasks.cuh does for the backward:
//   wait_for_inputs(scope, queued)                  its dependency, waited for by the scheduler
//   load_stage(maps, params, queued, coord, k_block, ...)  the TMA loads of one ring stage
//   run(scope, maps, params, queued, acc)           the consumers' compute, epilogue, signals
// A kind covers the routed experts' tiles and the shared expert's (TaskKind kGateUp and
// kSharedGateUp, kDown and kSharedDown): the same GEMM form on another set of maps, counters and
// schedule, so one compiled mainloop per form. visit_forward_task is the one place that maps a
// TaskKind to its struct: a new kind (the communication and combine tasks to come) is a struct here
// and one line there.
//
// Dependencies (counters in global memory, epoch * kGateUpDoneStride + count):
//   gate_up(m, n)  routed, with the fused local dispatch: rows gathered (wait_for_gathered_tile)
//                  signals (shared_)gate_up_done[m] once its TMA stores completed
//   down(m, n)     waits (shared_)gate_up_done[m] = every gate/up tile of row tile m
// Ordering of h: the TMA stores complete (cp.async.bulk.wait_group 0) -> fence.proxy.async ->
// red.release.gpu on the counter (count_stored_tile) -> the scheduler's ld.acquire.gpu ->
// fence.proxy.async.global -> its TMA loads of h.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>

#include "kernels/gemm/epilogue.cuh"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/gemm/gemm_loads.cuh"
#include "kernels/gemm/gemm_mainloop.cuh"
#include "kernels/persistent/launch.h"
#include "kernels/persistent/task_order.h"
#include "kernels/persistent/task_queue.cuh"
#include "kernels/stages/dispatch_local.cuh"

namespace mok::kernels {

static_assert(kOrderTileRows == BLOCK_M && kOrderTileColumns == BLOCK_N,
              "the task order counts the GEMM's tiles");

// A task as the consumers need it: kind (TaskKind, or kStopTask), row tile, column tile.
struct ForwardQueuedTask {
  int32_t kind;
  int32_t m_tile;
  int32_t n_tile;
  int32_t ticket;  // for the task trace
};

using ForwardStorage = GemmSharedStorage<kNumStages>;

// What the scheduler thread holds while it waits for a task's inputs.
struct ForwardSchedulerScope {
  const WaitContext& wait;
  const ForwardPlan& plan;
  unsigned long long epoch;         // this launch's
  unsigned long long gather_epoch;  // the fused local dispatch's (0: rows gathered before)
};

// The GEMM parameters of a task: the routed or the shared expert's, gate/up or down.
__device__ __forceinline__ const ExpertGemmParams& gemm_params_of(const ForwardGemmsParams& params,
                                                                  TaskKind kind) {
  switch (kind) {
    case TaskKind::kGateUp:
      return params.gate_up;
    case TaskKind::kSharedGateUp:
      return params.shared_gate_up;
    case TaskKind::kSharedDown:
      return params.shared_down;
    default:
      return params.down;
  }
}

__device__ __forceinline__ const ForwardSetMaps& set_maps_of(const ForwardGemmsMaps& maps,
                                                             const ForwardQueuedTask& task) {
  return is_shared(static_cast<TaskKind>(task.kind)) ? maps.shared : maps.routed;
}

__device__ __forceinline__ TileCoord coord_of(const ForwardGemmsParams& params,
                                              const ForwardQueuedTask& task) {
  const ExpertGemmParams& gemm = gemm_params_of(params, static_cast<TaskKind>(task.kind));
  TileCoord coord;
  coord.m_tile = task.m_tile;
  coord.n_tile = task.n_tile;
  coord.expert = gemm.tile_expert[task.m_tile];
  coord.k_row0 = 0;
  coord.num_k_blocks = gemm.k_extent / BLOCK_K;
  return coord;
}

// gate_up(m, n): a 128 x (128 gate + 128 up) tile with the SwiGLU epilogue (h, and bf16 g and u
// as the forward context).
struct GateUpTask {
  __device__ __forceinline__ static void wait_for_inputs(ForwardSchedulerScope& scope,
                                                         const ForwardGemmsParams& params,
                                                         const ForwardQueuedTask& queued) {
    if (queued.kind == static_cast<int32_t>(TaskKind::kGateUp) &&
        params.gate_up.gather.x != nullptr)
      wait_for_gathered_tile(scope.wait, params.gate_up.gather, queued.m_tile, scope.gather_epoch);
  }
  __device__ __forceinline__ static void load_stage(const ForwardSetMaps& maps,
                                                    const ForwardGemmsParams& params,
                                                    const ForwardQueuedTask& queued,
                                                    const TileCoord& coord, int k_block,
                                                    __nv_bfloat16* a_dst, __nv_bfloat16* b_dst,
                                                    uint64_t* full) {
    issue_loads<ExpertGemmForm::kGateUpSwiGLU>(
        &maps.x_rows, &maps.x_rows, &maps.w_gate, &maps.w_up,
        gemm_params_of(params, static_cast<TaskKind>(queued.kind)), coord, k_block, a_dst, b_dst,
        full);
  }
  __device__ __forceinline__ static void run(TaskConsumerScope& scope, const ForwardSetMaps& maps,
                                             const ForwardGemmsParams& params,
                                             const ForwardQueuedTask& task, float (&acc)[128]) {
    const auto kind = static_cast<TaskKind>(task.kind);
    const ExpertGemmParams& gemm = gemm_params_of(params, kind);
    consume_tile<false, false>(scope.wait, scope.smem, scope.state, gemm.k_extent / BLOCK_K,
                               scope.consumer_idx, acc);
    // After the mainloop: fewer live registers.
    store_tile<ExpertGemmForm::kGateUpSwiGLU>({&maps.hidden_out, &maps.gate_out, &maps.up_out},
                                              scope.smem, gemm, coord_of(params, task),
                                              scope.consumer_idx, acc);
    if (scope.issuer)
      count_stored_tile(
          (is_shared(kind) ? params.shared_gate_up_done : params.gate_up_done) + task.m_tile,
          scope.epoch);
  }
};

// down(m, n): a 128 x 256 tile of the expert output rows y = h Wd.
struct DownTask {
  __device__ __forceinline__ static void wait_for_inputs(ForwardSchedulerScope& scope,
                                                         const ForwardGemmsParams& params,
                                                         const ForwardQueuedTask& queued) {
    const auto kind = static_cast<TaskKind>(queued.kind);
    const bool shared = is_shared(kind);
    const Task task{kind, -1, queued.m_tile, queued.n_tile, -1};
    wait_for_count(scope.wait, shared ? WaitSite::kSharedGateUpDone : WaitSite::kGateUpDone,
                   (shared ? params.shared_gate_up_done : params.gate_up_done) + queued.m_tile,
                   scope.epoch, dependency_of(scope.plan, task).target);
    acquire_for_tma();
  }
  __device__ __forceinline__ static void load_stage(const ForwardSetMaps& maps,
                                                    const ForwardGemmsParams& params,
                                                    const ForwardQueuedTask& queued,
                                                    const TileCoord& coord, int k_block,
                                                    __nv_bfloat16* a_dst, __nv_bfloat16* b_dst,
                                                    uint64_t* full) {
    issue_loads<ExpertGemmForm::kDownStore>(
        &maps.hidden_in, &maps.hidden_in, &maps.w_down, &maps.w_down,
        gemm_params_of(params, static_cast<TaskKind>(queued.kind)), coord, k_block, a_dst, b_dst,
        full);
  }
  __device__ __forceinline__ static void run(TaskConsumerScope& scope, const ForwardSetMaps& maps,
                                             const ForwardGemmsParams& params,
                                             const ForwardQueuedTask& task, float (&acc)[128]) {
    const ExpertGemmParams& gemm = gemm_params_of(params, static_cast<TaskKind>(task.kind));
    consume_tile<false, false>(scope.wait, scope.smem, scope.state, gemm.k_extent / BLOCK_K,
                               scope.consumer_idx, acc);
    store_tile<ExpertGemmForm::kDownStore>({&maps.y_out, nullptr, nullptr}, scope.smem, gemm,
                                           coord_of(params, task), scope.consumer_idx, acc);
  }
};

// Calls `visitor` with the struct of `kind` (a value of it: the functions are static). kGather and
// kCombine are never queued by this kernel: the gather runs on the spare producer warps or before
// the launch, the combine after it.
template <typename Visitor>
__device__ __forceinline__ void visit_forward_task(TaskKind kind, Visitor&& visitor) {
  if (is_gate_up(kind))
    visitor(GateUpTask{});
  else  // kDown, kSharedDown
    visitor(DownTask{});
}

}  // namespace mok::kernels
