// The persistent forward GEMM kernel: every gate/up tile and every down tile of the forward in
// one launch, in the order of task_order.h (GEMM tiles only), with dependency counters instead
// of a kernel boundary between the two GEMMs (DESIGN.md §2.7). With a shared expert, its
// gate/up and down tiles follow the routed ones in the same ticket stream (in the launch of
// macrobatch 0, the last): the same GEMM forms on its own maps and fixed schedule.
//
// Grid: persistent, one 384-thread CTA per SM (or fewer resident: see Progress).
// Warp roles (each task kind's dependency, loads and compute are its struct in
// forward_tasks.cuh; the mainloop and epilogues are the expert GEMM's, gemm_mainloop.cuh and
// epilogue.cuh):
//   warpgroup 0, thread 0  the scheduler and TMA thread. Per task: takes the next ticket from
//                the global counter (before issuing the current task's loads, so the atomic's
//                latency hides behind them), maps it to a task (task_at with a cursor: this
//                CTA's tickets only grow), waits for the task's dependency (its kind's
//                wait_for_inputs), publishes the task in a 4-slot shared-memory queue
//                (task_queue.cuh), then issues the kind's K-block loads into the 3-stage ring.
//                After the last ticket it publishes a stop task.
//   warpgroup 0, warps 1-3 the fused local dispatch's gatherers when it is on
//                (dispatch_local.cuh), as in the standalone gate/up GEMM.
//   warpgroups 1, 2        consumers: read the task from the queue and run its kind's run:
//                the mainloop and the form's staging-tile epilogue (gate/up stores g, u and h
//                and signals its row tile's counter; down stores the expert output rows).
//                (Deferring a gate/up tile's signal until the next tile's stores were issued
//                measured no faster: docs/perf.md.)
// Dependencies and the ordering of h: forward_tasks.cuh.
// Progress: a ticket is taken only by a running scheduler, and a task waits only on tasks with
// smaller tickets, whose loads were all issued before their scheduler took its next ticket; so
// the kernel finishes with any number of resident CTAs (e.g. while another stream holds SMs).
// Epochs: the ticket and the counters only grow (see ForwardGemmsParams); nothing is reset.
#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/persistent/forward_tasks.cuh"
#include "kernels/persistent/launch.h"
#include "kernels/persistent/task_order.h"
#include "kernels/persistent/task_queue.cuh"
#include "kernels/persistent/task_trace.cuh"
#include "kernels/stages/dispatch_local.cuh"

namespace mok::kernels {

namespace {

using QueuedTask = ForwardQueuedTask;
using Storage = ForwardStorage;

__device__ __forceinline__ unsigned long long launch_epoch(const ForwardGemmsParams& params) {
  return *reinterpret_cast<const volatile unsigned long long*>(params.epoch) + 1;
}

// The launch's row tiles: its macrobatch's [tile_begin, tile_end) clipped to the filled tiles
// (every tile with one macrobatch); task m_tiles are offsets from the first.
__device__ __forceinline__ int first_m_tile(const ForwardGemmsParams& params) {
  return min(params.gate_up.macrobatch.tile_begin, params.gate_up.header->num_tiles);
}

__device__ __forceinline__ ForwardPlan plan_of(const ForwardGemmsParams& params) {
  return forward_gemms_plan(
      min(params.gate_up.macrobatch.tile_end, params.gate_up.header->num_tiles) -
          first_m_tile(params),
      params.minibatch_tiles, params.gate_up.n_extent, params.down.n_extent, params.shared_m_tiles,
      params.shared_m_tiles > 0 ? params.shared_gate_up.n_extent : 0);
}

__device__ __forceinline__ void schedule_and_load(const ForwardGemmsMaps& maps,
                                                  const ForwardGemmsParams& params, Storage& smem,
                                                  TaskQueue<QueuedTask>& queue) {
  const WaitContext& wait = params.gate_up.wait;
  const ForwardPlan plan = plan_of(params);
  const int64_t num_tasks_here = num_tasks(plan);
  const unsigned long long epoch = launch_epoch(params);
  const unsigned long long ticket_base = epoch << 32;
  const bool gathers = params.gate_up.gather.x != nullptr;
  ForwardSchedulerScope scope{wait, plan, epoch, gathers ? gather_epoch(params.gate_up.gather) : 0};
  PipelineState<kNumStages> state;
  uint32_t published = 0;  // tasks in the queue so far
  SegmentCursor cursor;    // this CTA's tickets only grow
  const int m_begin = first_m_tile(params);
  atomicMax(params.ticket, ticket_base);
  long long next_ticket = static_cast<long long>(atomicAdd(params.ticket, 1ull) - ticket_base);
  for (;;) {
    const long long ticket = next_ticket;
    const uint64_t ticket_ns = trace_clock(params.trace);
    QueuedTask queued{kStopTask, 0, 0, 0};
    if (ticket < num_tasks_here) {
      const Task task = task_at(plan, ticket, &cursor);
      // The shared expert's row tiles are its own schedule's, outside the macrobatch.
      queued = {static_cast<int32_t>(task.kind),
                is_shared(task.kind) ? task.m_tile : m_begin + task.m_tile, task.n_tile,
                static_cast<int32_t>(ticket)};
      const uint64_t decoded_ns = trace_clock(params.trace);
      visit_forward_task(task.kind,
                         [&](auto kind) { kind.wait_for_inputs(scope, params, queued); });
      trace_queued(params.trace, ticket, queued.kind, queued.m_tile, queued.n_tile, -1, ticket_ns,
                   decoded_ns, decoded_ns);
    }
    queue.publish(wait, published++, queued);
    if (queued.kind == kStopTask) return;
    // The next ticket now: the atomic's round trip overlaps this task's loads. (Its dependency
    // is waited for only after them: it may be this very task.)
    next_ticket = static_cast<long long>(atomicAdd(params.ticket, 1ull) - ticket_base);
    const TileCoord coord = coord_of(params, queued);
    const ForwardSetMaps& set_maps = set_maps_of(maps, queued);
    visit_forward_task(static_cast<TaskKind>(queued.kind), [&](auto kind) {
      for (int k_block = 0; k_block < coord.num_k_blocks; ++k_block)
        produce_stage(wait, smem, state, kTileABytes + kTileBBytes,
                      [&](__nv_bfloat16* a_dst, __nv_bfloat16* b_dst, uint64_t* full) {
                        kind.load_stage(set_maps, params, queued, coord, k_block, a_dst, b_dst,
                                        full);
                      });
    });
  }
}

__global__ void __launch_bounds__(kNumThreads, 1)
    forward_gemms_kernel(const __grid_constant__ ForwardGemmsMaps maps,
                         const __grid_constant__ ForwardGemmsParams params) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Storage& smem = ptx::align_shared_1024<Storage>(smem_raw);
  auto& queue =
      *reinterpret_cast<TaskQueue<QueuedTask>*>(reinterpret_cast<char*>(&smem) + sizeof(Storage));
  if (threadIdx.x == 0) queue.init();
  init_pipeline(smem);  // also fences the barrier inits and syncs the CTA
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    const FusedGather& gather = params.gate_up.gather;
    if (threadIdx.x == 0) {
      for (const CUtensorMap* map : {&maps.routed.x_rows, &maps.routed.w_gate, &maps.routed.w_up,
                                     &maps.routed.hidden_in, &maps.routed.w_down})
        ptx::prefetch_tensor_map(map);
      schedule_and_load(maps, params, smem, queue);
    } else if (gather.x != nullptr && threadIdx.x >= 32) {
      gather_rows_into_tiles(gather, params.gate_up.header, params.gate_up.row_pair,
                             gather_epoch(gather));
    }
  } else {
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    const int consumer_idx = warpgroup - 1;
    PipelineState<kNumStages> state;
    const bool issuer = threadIdx.x == BLOCK_M;
    TaskConsumerScope scope{params.gate_up.wait, smem,   state,
                            consumer_idx,        issuer, launch_epoch(params)};
    // Registers are tight here (128 accumulators of 168): keep little else live across tiles.
    uint32_t queued_count = 0;  // tasks read so far
    float acc[128];
    for (;;) {
      const QueuedTask task = queue.read(params.gate_up.wait, queued_count++);
      if (task.kind == kStopTask) break;
      if (issuer) trace_started(params.trace, task.ticket);
      visit_forward_task(static_cast<TaskKind>(task.kind), [&](auto kind) {
        kind.run(scope, set_maps_of(maps, task), params, task, acc);
      });
      if (issuer) trace_finished(params.trace, task.ticket);
    }
    // Outstanding TMA stores read the staging tile: it must outlive them.
    if (issuer) ptx::bulk_wait_group<0>();
  }
}

}  // namespace

cudaError_t launch_forward_gemms(const ForwardGemmsMaps& maps, const ForwardGemmsParams& params,
                                 int num_ctas, cudaStream_t stream) {
  const size_t smem_bytes = sizeof(Storage) + sizeof(TaskQueue<QueuedTask>) + 1024;
  cudaError_t status =
      cudaFuncSetAttribute(forward_gemms_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem_bytes));
  if (status != cudaSuccess) return status;
  forward_gemms_kernel<<<num_ctas, kNumThreads, smem_bytes, stream>>>(maps, params);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("forward_gemms.cu", {kernel_symbol(&forward_gemms_kernel)});
}  // namespace

}  // namespace mok::kernels
