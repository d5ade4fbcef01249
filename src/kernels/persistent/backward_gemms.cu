// The persistent backward kernel: every task of the routed experts' backward in one launch, in
// the order of backward_task_order.h, with dependency counters instead of kernel boundaries
// (DESIGN.md §2.5, §2.7). The rows (d_out, and x for the recompute) are gathered by the spare
// producer warps during the launch (the forward's fused local dispatch, dispatch_local.cuh), or
// before it (expert parallel: expanded from the received rows); the rows(m) tickets are skipped
// either way. The fixed-order d_x combine runs after the launch, so the plan has no combine
// tasks; one macrobatch (the layer runs the kernel sequence otherwise). With a shared expert
// (params.num_sets = 2) its tasks run in the same ticket stream, merged into the routed order
// (backward_task_order.h), on its own maps, parameters and counters: a queued task names its set.
//
// Grid: persistent, one 384-thread CTA per SM (or fewer resident: see Progress).
// Warp roles (each task kind's dependency, loads and compute are its struct in
// backward_tasks.cuh; the mainloop, the loads and the epilogues are the expert GEMM's:
// gemm_mainloop.cuh, gemm_loads.cuh, epilogue.cuh):
//   warpgroup 0, thread 0  the scheduler and TMA thread. Per task: takes a ticket from the
//                global counter (the next one before issuing the current task's loads), maps it
//                to a task (backward_task_at with a cursor: this CTA's tickets only grow, and
//                the cursor keeps what is costly to recompute) and its kind's describe, waits
//                for the task's dependency (wait_for_inputs), publishes the task in a 4-slot
//                shared-memory queue (task_queue.cuh), then issues the kind's loads into the
//                3-stage ring: a GEMM tile's K-blocks, or a SwiGLU task's row blocks
//                (swiglu_backward_task.cuh). After the last ticket it publishes a stop task.
//   warpgroup 0, warps 1-3 gather the rows (d_out_gather, x_gather: a global ticket per row, a
//                count per 128-row tile), then exit.
//   warpgroups 1, 2        consumers: read the task from the queue and run its kind's run:
//                recompute(m, n)      mainloop + kGateUpStore epilogue (bf16 g, u)
//                down_dgrad(m, n)     mainloop + kDownGrad epilogue (dh_raw)
//                swiglu(m)            the eight consumer warps run the SwiGLU backward of the
//                                     row tile's 128 rows from the stages (d_g, d_u, h_w in
//                                     place of dh_raw, the router-weight gradients)
//                gate_up_dgrad(m, n)  mainloop + kGateUpGradStore epilogue (the dx rows)
//                wgrad(e, matrix, t)  mainloop over expert e's rows + kWeightGrad epilogue
// Dependencies and their memory ordering: backward_tasks.cuh.
// Progress: a ticket is taken only by a running scheduler, and a task waits only on tasks with
// smaller tickets, which were all queued (and their loads issued) before their scheduler took
// its next ticket; so the kernel finishes with any number of resident CTAs.
// Epochs: the ticket and the counters only grow; nothing is reset (graph replays work).
#include <cuda.h>
#include <cuda_bf16.h>

#include "kernels/common/kernel_preload.h"
#include "kernels/gemm/expert_gemm_params.h"
#include "kernels/persistent/backward_task_order.h"
#include "kernels/persistent/backward_tasks.cuh"
#include "kernels/persistent/launch.h"
#include "kernels/persistent/task_queue.cuh"
#include "kernels/persistent/task_trace.cuh"
#include "kernels/stages/dispatch_local.cuh"

namespace mok::kernels {

namespace {

using QueuedTask = BackwardQueuedTask;
using Storage = BackwardStorage;

__device__ __forceinline__ unsigned long long launch_epoch(const BackwardGemmsParams& params) {
  return *reinterpret_cast<const volatile unsigned long long*>(params.epoch) + 1;
}

// The plan of one expert set; `expert_tiles` (shared memory, E + 1 entries) holds each
// expert's first row tile.
__device__ __forceinline__ BackwardPlan plan_of(const BackwardSetParams& params,
                                                const int32_t* expert_tiles) {
  return backward_plan(params.down_dgrad.header->num_tiles, params.minibatch_tiles,
                       params.recompute_rows != 0, params.down_dgrad.n_extent,
                       params.gate_up_dgrad.n_extent, params.down_dgrad.num_experts, expert_tiles);
}

// What the consumers need of `task`: its kind's describe.
__device__ __forceinline__ QueuedTask queued_task(const BackwardSetParams& params,
                                                  const BackwardPlan& plan,
                                                  const BackwardTask& task) {
  QueuedTask queued{
      static_cast<int32_t>(task.kind), task.set, task.m_tile, task.n_tile, -1, -1, 0, 0, -1};
  visit_backward_task(task.kind, [&](auto kind) { kind.describe(params, plan, task, queued); });
  return queued;
}

__device__ __forceinline__ void schedule_and_load(const BackwardGemmsMaps& maps,
                                                  const BackwardGemmsParams& params, Storage& smem,
                                                  TaskQueue<QueuedTask>& queue,
                                                  const int32_t* const expert_tiles[2]) {
  const BackwardSetParams& routed = params.sets[0];
  const WaitContext& wait = routed.down_dgrad.wait;
  BackwardPlans plans;
  plans.num_sets = params.num_sets;
  for (int set = 0; set < params.num_sets; ++set)
    plans.sets[set] = plan_of(params.sets[set], expert_tiles[set]);
  const int64_t num_tasks_here = num_tasks(plans);
  const unsigned long long epoch = launch_epoch(params);
  const unsigned long long ticket_base = epoch << 32;
  // Only the routed set gathers rows (the shared expert's are the tokens themselves).
  const unsigned long long d_out_epoch =
      routed.d_out_gather.x != nullptr ? gather_epoch(routed.d_out_gather) : 0;
  const unsigned long long x_epoch =
      routed.x_gather.x != nullptr ? gather_epoch(routed.x_gather) : 0;
  PipelineState<kNumStages> state;
  uint32_t published = 0;  // tasks in the queue so far
  SegmentCursor cursor;    // this CTA's tickets only grow
  BackwardSchedulerScope scope{wait, plans, epoch, d_out_epoch, x_epoch, -1};
  // Decodes `ticket` (taking further tickets past the rows tasks, which the spare warps or the
  // expansion before the launch ran) into the task the consumers need; past the last task, the
  // stop task. Runs after the current task's loads are issued, while the consumers still have
  // its last stages to compute (the decode takes 1-2 us on this 56-register thread, traced).
  uint64_t ticket_ns = 0, decoded_ns = 0;  // of the task decoded last (the task trace)
  auto decode = [&](long long ticket) {
    ticket_ns = trace_clock(params.trace);
    QueuedTask queued{kStopTask, 0, 0, 0, 0, 0, 0, 0, -1};
    while (ticket < num_tasks_here) {
      const BackwardTask task = backward_task_at(plans, ticket, &cursor);
      if (task.kind != BackwardTaskKind::kRows) {
        queued = queued_task(params.sets[task.set], plans.sets[task.set], task);
        queued.ticket = static_cast<int32_t>(ticket);
        break;
      }
      ticket = static_cast<long long>(atomicAdd(params.ticket, 1ull) - ticket_base);
      ticket_ns = trace_clock(params.trace);
    }
    decoded_ns = trace_clock(params.trace);
    return queued;
  };
  atomicMax(params.ticket, ticket_base);
  QueuedTask next = decode(static_cast<long long>(atomicAdd(params.ticket, 1ull) - ticket_base));
  for (;;) {
    const QueuedTask queued = next;
    if (queued.kind != kStopTask) {
      // Its dependency, now that the previous task's loads are all issued (progress: a task
      // waits only for smaller tickets, whose loads were issued before theirs was queued).
      const uint64_t wait_ns = trace_clock(params.trace);
      visit_backward_task(static_cast<BackwardTaskKind>(queued.kind), [&](auto kind) {
        kind.wait_for_inputs(scope, params.sets[queued.set], queued);
      });
      // The trace's kinds: the routed set's BackwardTaskKind, then the shared set's.
      trace_queued(params.trace, queued.ticket, queued.kind + queued.set * kNumBackwardTaskKinds,
                   queued.m_tile, queued.n_tile, queued.expert, ticket_ns, decoded_ns, wait_ns);
    }
    queue.publish(wait, published++, queued);
    if (queued.kind == kStopTask) return;
    // The next ticket now: the atomic's round trip overlaps this task's first loads.
    const long long next_ticket =
        static_cast<long long>(atomicAdd(params.ticket, 1ull) - ticket_base);
    const TileCoord coord = coord_of(queued);
    const BackwardSetMaps& set_maps = maps.sets[queued.set];
    const BackwardSetParams& set = params.sets[queued.set];
    // The next ticket is decoded after the last K-block is issued, while the consumers work
    // through the ring's last stages. Decoding after the first K-block instead (to hide it behind
    // the previous task) held the decode's state live across the K-block loop: the producer
    // spilled in it and every GEMM tile ran 25-30% longer (docs/perf.md, session 7).
    visit_backward_task(static_cast<BackwardTaskKind>(queued.kind), [&](auto kind) {
      for (int k_block = 0; k_block < coord.num_k_blocks; ++k_block)
        produce_stage(wait, smem, state, kind.stage_bytes(set, k_block),
                      [&](__nv_bfloat16* a_dst, __nv_bfloat16* b_dst, uint64_t* full) {
                        kind.load_stage(set_maps, set, queued, coord, k_block, a_dst, b_dst, full);
                      });
    });
    next = decode(next_ticket);
  }
}

__global__ void __launch_bounds__(kNumThreads, 1)
    backward_gemms_kernel(const __grid_constant__ BackwardGemmsMaps maps,
                          const __grid_constant__ BackwardGemmsParams params) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Storage& smem = ptx::align_shared_1024<Storage>(smem_raw);
  auto& queue =
      *reinterpret_cast<TaskQueue<QueuedTask>*>(reinterpret_cast<char*>(&smem) + sizeof(Storage));
  // Each set's expert row-tile starts (E_loc + 1 entries, then 2 for the shared expert).
  const BackwardSetParams& routed = params.sets[0];
  int32_t* routed_tiles = reinterpret_cast<int32_t*>(&queue + 1);
  int32_t* shared_tiles = routed_tiles + routed.down_dgrad.num_experts + 1;
  for (int set = 0; set < params.num_sets; ++set) {
    const ExpertGemmParams& gemm = params.sets[set].down_dgrad;
    int32_t* tiles = set == 0 ? routed_tiles : shared_tiles;
    for (int e = threadIdx.x; e <= gemm.num_experts; e += blockDim.x)
      tiles[e] = gemm.expert_offsets[e] / BLOCK_M;
  }
  if (threadIdx.x == 0) queue.init();
  init_pipeline(smem);  // also fences the barrier inits and syncs the CTA
  const int warpgroup = threadIdx.x / 128;

  if (warpgroup == 0) {
    ptx::setmaxnreg_dec<kProducerRegisters>();
    if (threadIdx.x == 0) {
      const BackwardSetMaps& routed_maps = maps.sets[0];
      for (const CUtensorMap* map :
           {&routed_maps.x_rows, &routed_maps.d_out_rows, &routed_maps.w_down_mn,
            &routed_maps.d_gate, &routed_maps.d_up, &routed_maps.d_gate_mn, &routed_maps.x_mn})
        ptx::prefetch_tensor_map(map);
      const int32_t* const expert_tiles[2] = {routed_tiles, shared_tiles};
      schedule_and_load(maps, params, smem, queue, expert_tiles);
    } else if (threadIdx.x >= 32) {
      // The spare warps gather the routed rows (any CTA's warps take any row: progress with any
      // number of resident CTAs).
      const ScheduleHeader* header = routed.down_dgrad.header;
      if (routed.d_out_gather.x != nullptr)
        gather_rows_into_tiles(routed.d_out_gather, header, routed.down_dgrad.row_pair,
                               gather_epoch(routed.d_out_gather));
      if (routed.x_gather.x != nullptr)
        gather_rows_into_tiles(routed.x_gather, header, routed.down_dgrad.row_pair,
                               gather_epoch(routed.x_gather));
    }
  } else {
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    const int consumer_idx = warpgroup - 1;
    const bool issuer = threadIdx.x == BLOCK_M;
    const unsigned long long epoch = launch_epoch(params);
    const WaitContext& wait = routed.down_dgrad.wait;
    PipelineState<kNumStages> state;
    TaskConsumerScope scope{wait, smem, state, consumer_idx, issuer, epoch};
    uint32_t queued_count = 0;  // tasks read so far
    // The accumulators stay live across tasks in ptxas's view (the wgmma operands read them),
    // so the SwiGLU task's registers come on top of them: ptxas spills ~200 bytes here
    // (docs/perf.md). Zeroing them after the SwiGLU task would end their life there, but made
    // ptxas serialize every wgmma (C7515).
    float acc[128];
    for (;;) {
      const QueuedTask task = queue.read(wait, queued_count++);
      if (task.kind == kStopTask) break;
      if (issuer) trace_started(params.trace, task.ticket);
      visit_backward_task(static_cast<BackwardTaskKind>(task.kind), [&](auto kind) {
        kind.run(scope, params.sets[task.set], maps.sets[task.set], task, acc);
      });
      if (issuer) trace_finished(params.trace, task.ticket);
    }
    // Outstanding TMA stores read the staging tile: it must outlive them.
    if (issuer) ptx::bulk_wait_group<0>();
  }
}

}  // namespace

cudaError_t launch_backward_gemms(const BackwardGemmsMaps& maps, const BackwardGemmsParams& params,
                                  int num_ctas, cudaStream_t stream) {
  if (num_ctas < 1 || params.num_sets < 1 || params.num_sets > 2) return cudaErrorInvalidValue;
  for (int set = 0; set < params.num_sets; ++set)
    if (params.sets[set].down_dgrad.num_experts < 0 || params.sets[set].minibatch_tiles < 1)
      return cudaErrorInvalidValue;
  // The sets' expert row-tile starts follow the queue: E_loc + 1, and 2 for the shared expert.
  const size_t smem_bytes = sizeof(Storage) + sizeof(TaskQueue<QueuedTask>) +
                            (static_cast<size_t>(params.sets[0].down_dgrad.num_experts) + 3) * 4 +
                            1024;
  cudaError_t status =
      cudaFuncSetAttribute(backward_gemms_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           static_cast<int>(smem_bytes));
  if (status != cudaSuccess) return status;
  backward_gemms_kernel<<<num_ctas, kNumThreads, smem_bytes, stream>>>(maps, params);
  return cudaGetLastError();
}

// Loaded up front by expert-parallel groups (kernel_preload.h).
namespace {
const KernelPreloadList kPreload("backward_gemms.cu", {kernel_symbol(&backward_gemms_kernel)});
}  // namespace

}  // namespace mok::kernels
